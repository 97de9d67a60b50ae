"""OpenAI's Embeddings API (`POST /v1/embeddings`) as pydantic models: the request and its answer.

The request has OpenAI's fields and those of vLLM's that an embedding client sends; each is honoured
(docs/api_fields.md lists them), and any other is refused as OpenAI refuses it ("Unrecognized request
argument supplied: X"), typed strictly as `openai_protocol`'s requests are. `dimensions` is honoured only by
a Matryoshka model (`model/pooling.py`); elsewhere it is a 400 naming it.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's bound on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "examples": [{"input": ["the cat runs", "a dog sleeps"], "encoding_format": "float"}]})

    # OpenAI's
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # an end-user id for abuse monitoring: no effect on the vectors by definition
    # vLLM's
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each input: a text or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]
        return list(value)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or with encoding_format base64 their float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
