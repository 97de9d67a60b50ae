"""The HTTP process's first-use costs, paid at start-up rather than by the first request: the engine core
runs its own warm-up before it says Ready (`parallel/warmup.py`), and this one before the app's lifespan
(`warmed_up`), so before the server turns RUNNING and `/ready` answers 200.

What a first chat request would otherwise do once: compile the chat template and read which variables it
uses (jinja2; both kept per template, the second shared with the tool-call parser's choice), encode with
the tokenizer and decode incrementally, and import the event-loop machinery of a streamed response
(starlette runs it in an anyio task group, whose asyncio backend anyio imports at its first use).

Nothing of it is a request: no admission, no log line, no metric, nothing sent to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse

from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.detokenizer import IncrementalDetokenizer
from gracelm.lifecycle.heap import release_freed_memory
from gracelm.model.tokenizer import Tokenizer
from gracelm.serving import chat_prompt
from gracelm.serving.api_errors import APIError
from gracelm.serving.openai_protocol import ChatCompletionRequest

logger = logging.getLogger(__name__)

_GREETING = "Hello, who are you?"
_CHAT = ChatCompletionRequest(messages=[{"role": "user", "content": _GREETING}])


Lifespan = Callable[[Any], contextlib.AbstractAsyncContextManager]


def warmed_up(lifespan: Lifespan, engine: AsyncEngine) -> Lifespan:
    """`lifespan`, entered once the warm-up is done."""

    @contextlib.asynccontextmanager
    async def run(app: Any) -> AsyncIterator[Any]:
        assert engine.config.max_model_len is not None  # set from the core's Ready
        await warm_up_serving(engine.tokenizer, engine.config.max_model_len)
        # What the start-up freed (the tokenizer's parse, the core's Ready, the imports' transients) goes
        # back to the system now, as the engine core's does: the heap would otherwise keep it resident.
        release_freed_memory()
        async with lifespan(app) as state:
            yield state

    return run


async def warm_up_serving(tokenizer: Tokenizer, max_model_len: int) -> None:
    """A chat prompt rendered and its tokens decoded, and one streamed response sent nowhere."""
    try:
        ids = await chat_prompt.prompt_ids(tokenizer, _CHAT, max_model_len)
    except APIError as exc:  # a template that refuses this conversation: no chat to warm, plain text still
        logger.debug("warm-up: the chat template refused its conversation: %s", exc.message)
        ids = tokenizer.encode(_GREETING)
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:1])
    for token_id in ids[1:]:
        detokenizer.add_token(token_id)
    detokenizer.stream_delta()
    await _stream_nowhere()


async def _stream_nowhere() -> None:
    """One server-sent event through starlette's streamed response, as the routes send theirs."""
    async def events():
        yield "data: {}\n\n"

    async def receive() -> dict:  # the client never leaves: the response ends when its events do
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(_message: dict) -> None:
        pass

    await StreamingResponse(events(), media_type="text/event-stream")({"type": "http"}, receive, send)
