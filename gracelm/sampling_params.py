"""How to pick tokens for one request: OpenAI's fields plus vLLM's extras, validated on construction."""

from __future__ import annotations

import msgspec

# Temperatures below this sample greedily (as vLLM does): logits divided by less would leave float32's range.
GREEDY_BELOW = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling settings of one request; crosses the process boundary as-is (msgspec).

    `temperature == 0` (or below `GREEDY_BELOW`) means greedy. `top_k` of 0 or -1 and `top_p == 1` disable
    those filters.
    `max_tokens=None` lets the request run to the end of the context (`max_model_len`).
    `logprobs=N` returns, for each generated token, its logprob and the N most likely alternatives.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be at least 1, got {self.max_tokens}")
        _check(0.0 <= self.temperature <= 2.0, "temperature", f"must be in [0, 2], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty}")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"must be between 0 and 20, got {self.logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative token ids")
        _check(self.seed is None or isinstance(self.seed, int), "seed",
               f"must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")
