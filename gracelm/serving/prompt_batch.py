"""Several prompts in one completions request (`prompt: ["a", "b"]` or a list of token lists): one engine
request per prompt, all added before the engine's next step so that they run in the same batches, and their
deltas merged into one stream whose choices are numbered as OpenAI numbers them, `prompt_index * n + j`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator

from gracelm.engine.output_processor import RequestOutput

_END = object()


async def merged(request_id: str, streams: list[AsyncGenerator[RequestOutput]],
                 n: int) -> AsyncGenerator[RequestOutput]:
    """The deltas of every prompt's stream as they come, as deltas of one request; an exception of any
    stream ends the whole. Closing this closes every stream (which aborts their engine requests)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
            return
        await queue.put((index, _END))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    exhausted = [False] * len(streams)
    finished = [False] * len(streams)
    try:
        while not all(exhausted):
            index, item = await queue.get()
            if item is _END:
                exhausted[index] = True
                continue
            if isinstance(item, BaseException):
                raise item
            finished[index] = item.finished
            outputs = [dataclasses.replace(o, index=index * n + o.index) for o in item.outputs]
            yield RequestOutput(request_id, None, [], outputs, all(finished), item.metrics)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()
