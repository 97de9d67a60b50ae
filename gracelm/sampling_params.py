"""How to pick tokens for one request: OpenAI's fields plus vLLM's extras, validated on construction."""

from __future__ import annotations

import msgspec

from gracelm.structured_output import StructuredOutputs
from gracelm.thinking_span import ThinkingSpan

# OpenAI's limit on choices per request: the fan-out one request may ask of the engine.
MAX_N = 128
# Integers cross the process boundary as msgpack int64/uint64 and feed int32/int64 tensors: larger ones are
# refused here, naming the field, instead of failing deep inside the engine.
_MAX_COUNT = 2**31 - 1
_SEED_RANGE = (-(2**63), 2**64 - 1)
# Temperatures below this sample greedily (as vLLM does): logits divided by less would leave float32's range.
GREEDY_BELOW = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling settings of one request; crosses the process boundary as-is (msgspec).

    `temperature == 0` (or below `GREEDY_BELOW`) means greedy. `top_k` of 0 or -1 and `top_p == 1` disable
    those filters.
    `max_tokens=None` lets the request run to the end of the context (`max_model_len`).
    `logprobs=N` returns, for each generated token, its logprob and the N most likely alternatives;
    `prompt_logprobs=N` the same for each prompt token after the first.
    `min_tokens` holds off the stop tokens (EOS, `stop_token_ids`) and stop strings until that many tokens
    are generated. `include_stop_str_in_output` keeps the stop string (or stop token's text) in the text.
    `skip_special_tokens` leaves special tokens out of the text; when they are kept,
    `spaces_between_special_tokens` puts a space between each of them and its neighbours.
    Token constraints, applied before penalties and filters: `structured_outputs` constrains the text to a
    JSON schema, a regular expression, a choice or a grammar; `logit_bias` adds its bias (-100 to 100, as
    OpenAI) to a token's logit; `allowed_token_ids` leaves only those tokens possible; `bad_words` are never
    produced (the last token of a word's tokens is banned whenever the tokens before it were just produced).
    `thinking` (set by a reasoning parser) is the thinking that opens the output: `structured_outputs`
    constrains only the answer after it.
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
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    thinking: ThinkingSpan | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(1 <= self.n <= MAX_N, "n", f"must be between 1 and {MAX_N}, got {self.n}")
        _check(self.max_tokens is None or 1 <= self.max_tokens <= _MAX_COUNT, "max_tokens",
               f"must be between 1 and {_MAX_COUNT}, got {self.max_tokens}")
        _check(0.0 <= self.temperature <= 2.0, "temperature", f"must be in [0, 2], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(-1 <= self.top_k <= _MAX_COUNT, "top_k",
               f"must be -1 (off), 0 (off) or positive up to {_MAX_COUNT}, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty}")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"must be between 0 and 20, got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
               f"must be between 0 and 20, got {self.prompt_logprobs}")
        _check(0 <= self.min_tokens <= _MAX_COUNT, "min_tokens",
               f"must be between 0 and {_MAX_COUNT}, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and 0 <= t <= _MAX_COUNT for t in self.stop_token_ids),
               "stop_token_ids", f"must be token ids between 0 and {_MAX_COUNT}")
        _check(all(isinstance(t, int) and 0 <= t <= _MAX_COUNT and -100.0 <= b <= 100.0
                   for t, b in self.logit_bias.items()), "logit_bias",
               f"must map token ids (0 to {_MAX_COUNT}) to biases between -100 and 100")
        allowed = self.allowed_token_ids
        _check(allowed is None or (bool(allowed) and all(isinstance(t, int) and 0 <= t <= _MAX_COUNT
                                                         for t in allowed)), "allowed_token_ids",
               f"must be a non-empty list of token ids between 0 and {_MAX_COUNT}")
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
               "must be non-blank strings")
        low, high = _SEED_RANGE
        _check(self.seed is None or (isinstance(self.seed, int) and low <= self.seed <= high), "seed",
               f"must be an integer between {low} and {high}, got {self.seed!r}")

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` of `n`: `seed + index`, wrapped to stay in the seed's range."""
        if self.seed is None:
            return None
        seed = self.seed + index
        return seed - 2**64 if seed > _SEED_RANGE[1] else seed

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {message}")
