"""`Engine`: offline batch inference that blocks until every request is done, with vLLM's names.

It runs the shared frontend (`frontend.py`) in the caller's process and the model in an engine-core process
of its own. It installs no signal handler: Ctrl-C in `generate()` is the user's `KeyboardInterrupt`, and the
requests are aborted on its way out.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tqdm import tqdm

from gracelm.config import EngineConfig
from gracelm.engine import messages as msg
from gracelm.engine.frontend import EMBEDDING_PARAMS, EngineFrontend, FatalHandler, Messages, Prompt
from gracelm.engine.output_processor import RequestOutput
from gracelm.lifecycle.process_end import ProcessEnd
from gracelm.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (`Engine.embed`): its tokens and its vector, pooled and normalised as the model
    defines (`model/pooling.py`); None when the request did not finish (the engine stopped first)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float] | None


class Engine(EngineFrontend):
    """`Engine(model, **options)`: the options are `EngineConfig`'s fields.

    One caller at a time: the calls are not meant to run concurrently from several threads.
    """

    def __init__(self, model: str | None = None, *, on_fatal: FatalHandler | None = None,
                 **options: Any) -> None:
        self._request_ids = itertools.count()
        super().__init__(EngineConfig(model=model, **options), on_fatal=on_fatal)

    @classmethod
    def from_config(cls, config: EngineConfig, *, on_fatal: FatalHandler | None = None) -> Engine:
        engine = cls.__new__(cls)
        engine._request_ids = itertools.count()
        EngineFrontend.__init__(engine, config, on_fatal=on_fatal)
        return engine

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Runs every prompt (a string or a token-id list, or a list of them) to completion, in order.
        `priority` (one for all, or one per prompt): a lower value runs first, as in the server."""
        self._check_usable()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, text or token ids
        params = SamplingParams() if sampling_params is None else sampling_params
        all_params = _per_prompt(params, SamplingParams, len(prompts))
        priorities = _per_prompt(priority, int, len(prompts))
        prepared = [(*self._prepare(prompt, params, rank), params, rank)
                    for prompt, params, rank in zip(prompts, all_params, priorities, strict=True)]
        return self._run(prepared, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True,
              priority: int | Sequence[int] = 0, dimensions: int | None = None) -> list[EmbeddingOutput]:
        """The embedding of every prompt (as `generate` takes them), in order, from an engine of task embed;
        `dimensions` truncates a Matryoshka model's vectors before they are normalised."""
        self._check_usable()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if dimensions is not None and self.pooling is not None:
            problem = self.pooling.check_dimensions(dimensions, self.model_config.hidden_size)
            if problem is not None:
                raise ValueError(f"dimensions {problem}")
        priorities = _per_prompt(priority, int, len(prompts))
        prepared = [(*self._prepare(prompt, EMBEDDING_PARAMS, rank, embedding=True), EMBEDDING_PARAMS, rank)
                    for prompt, rank in zip(prompts, priorities, strict=True)]
        outputs = self._run(prepared, use_tqdm, embedding=True)
        assert self.pooling is not None  # `_prepare` refused embeddings otherwise
        return [EmbeddingOutput(o.request_id, o.prompt_token_ids, None if o.outputs[0].embedding is None
                                else self.pooling.finished(o.outputs[0].embedding, dimensions))
                for o in outputs]

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation (a list of messages) or to several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self._conversation_ids(c) for c in conversations], sampling_params, use_tqdm,
                             priority)

    def stats(self) -> dict:
        self._check_usable()
        with self._utility_call("stats") as call_id:
            while True:
                message = self._next_message()
                if isinstance(message, msg.UtilityReply) and message.call_id == call_id:
                    if message.error is not None:
                        raise RuntimeError(message.error)
                    assert message.result is not None
                    return message.result
                if isinstance(message, msg.OutputsBatch):
                    self._process(message)

    def _run(self, prepared: list[tuple[str | None, list[int], SamplingParams, int]],
             use_tqdm: bool, embedding: bool = False) -> list[RequestOutput]:
        request_ids = [str(next(self._request_ids)) for _ in prepared]
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prepared), desc="generating", disable=not use_tqdm)
        try:
            for request_id, (text, ids, params, priority) in zip(request_ids, prepared, strict=True):
                self._add(request_id, text, ids, params, priority, embedding=embedding)
            finished = 0
            while finished < len(request_ids):
                message = self._next_message()
                if not isinstance(message, msg.OutputsBatch):
                    continue
                for delta in self._process(message):
                    if delta.request_id in results:
                        results[delta.request_id].add(delta)
                    else:
                        results[delta.request_id] = delta
                    if delta.finished:
                        finished += 1
                        bar.update(1)
        finally:
            bar.close()
            for request_id in request_ids:  # after an interruption, the core must not work for nobody
                self._abort(request_id)
        return [results[request_id] for request_id in request_ids]

    def _next_message(self) -> msg.FromCore:
        """The core's next message; raises `EngineDeadError` once it has ended and said everything."""
        inbox = self._client.monitor.inbox
        if self._shut_down or (self._client.end is not None and inbox.empty()):
            raise self._dead_error()
        item = inbox.get()
        if isinstance(item, ProcessEnd):
            raise self._dead_error()
        return item

    def _process(self, message: msg.OutputsBatch) -> list[RequestOutput]:
        processed = self._processor.process(message.outputs)
        self._client.abort_requests(processed.core_ids_to_abort)
        self._update_busy()
        return processed.deltas


def _per_prompt(value: T | Sequence[T], kind: type[T], count: int) -> list[T]:
    """One value for each prompt: the same for all, or the list given (one a prompt)."""
    if isinstance(value, kind):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"got {len(value)} {kind.__name__} values for {count} prompts")
    return list(value)
