"""`POST /v1/embeddings`: each input's vector from an embedding model (`gracelm serve --task embed`).

The inputs of one request run as one batch of engine requests (`prompt_batch.py`, as completions prompts
do), each a prefill whose pooled hidden states come back instead of a token (`engine/scheduler.py`), so
embeddings take their turn in the engine's steps, admission and drain as generation does. The vector is
truncated to `dimensions` (a Matryoshka model only) and normalised as the model defines, unless vLLM's
`normalize: false` asks for it raw (`model/pooling.py`); `encoding_format: base64` sends its little-endian
float32 bytes, as OpenAI does.
"""

from __future__ import annotations

import array
import base64
import sys

from gracelm.engine.frontend import EMBEDDING_PARAMS, TaskError, check_task
from gracelm.model.pooling import Pooling
from gracelm.serving.api_errors import APIError
from gracelm.serving.embeddings_protocol import (
    MAX_INPUTS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from gracelm.serving.request_client import RequestClient
from gracelm.serving.request_fields import truncate_prompt
from gracelm.serving.serving_base import ServingBase, task_error


class ServingEmbedding(ServingBase):
    async def create(self, req: EmbeddingRequest, client: RequestClient) -> EmbeddingResponse:
        """The answer to `req` from `client`; raises `APIError`."""
        self.check_model(req.model)
        pooling = self._pooling()
        if req.dimensions is not None:
            problem = pooling.check_dimensions(req.dimensions, self.engine.model_config.hidden_size)
            if problem is not None:
                raise APIError(400, f"dimensions {problem}", param="dimensions", code="invalid_value")
        prompts = self._prompts(req)
        request_id = client.request_id(req.request_id, "embd")
        run = await self.start(client, prompts, EMBEDDING_PARAMS, request_id, "input", api="embeddings",
                               priority=client.priority(req.priority), embedding=True)
        final = await self.final_output(client, run)  # every input's, or an APIError
        data = []
        for o in final.outputs:
            assert o.embedding is not None
            vector = pooling.finished(o.embedding, req.dimensions, req.normalize)
            data.append(EmbeddingData(index=o.index, embedding=_encoded(vector, req.encoding_format)))
        num_tokens = sum(len(ids) for ids in prompts)
        return EmbeddingResponse(id=request_id, model=self.model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

    def _pooling(self) -> Pooling:
        """The model's pooling; a generation model is refused before the inputs are read."""
        try:
            check_task(self.engine.pooling, embedding=True)
        except TaskError as exc:
            raise task_error(exc, self.model_name) from None
        assert self.engine.pooling is not None
        return self.engine.pooling

    def _prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        """Each input as token ids (a text encoded with the tokenizer's special tokens unless
        `add_special_tokens` is false), truncated if asked."""
        prompts = req.prompts
        if not prompts or len(prompts) > MAX_INPUTS:
            raise APIError(400, f"input must hold 1 to {MAX_INPUTS} inputs, got {len(prompts)}",
                           param="input", code="invalid_value")
        limit = self.engine.config.max_model_len
        assert limit is not None
        tokenizer = self.engine.tokenizer
        return [truncate_prompt(tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
                                if isinstance(p, str) else list(p), req.truncate_prompt_tokens, limit)
                for p in prompts]


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or as base64 of its float32 values in little-endian order (OpenAI's)."""
    if encoding_format == "float":
        return vector
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")
