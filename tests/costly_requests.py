"""The costliest request the default limits of `gracelm serve` allow, for the loop-lag test and bench: `n`
at its maximum (128), each choice with 20 logprobs, as many stop strings as allowed (64) with the total
length allowed (4096 characters), streamed. The stop strings begin like the tiny model's text ("the ", "a ",
...) so that their prefixes keep matching and the streams keep holding text back, and end in a character it
never writes, so that none ends a choice early."""

from __future__ import annotations

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64  # --max-stop-strings' default
MAX_STOP_CHARS = 4096  # --max-stop-chars' default
_WORDS = ("the ", "a ", "cat ", "dog ", "and ", "runs ", "red ", "model ")


def costliest_stop_strings() -> list[str]:
    length = MAX_STOP_CHARS // MAX_STOP_STRINGS
    stops = []
    for i in range(MAX_STOP_STRINGS):
        word = _WORDS[i % len(_WORDS)]
        body = (word * length)[:length - 2]
        stops.append(f"{body}{i % 10}\u2603")  # distinct, and never written by the model
    assert len(stops) == MAX_STOP_STRINGS and sum(map(len, stops)) == MAX_STOP_CHARS
    return stops


def costliest_completion(max_tokens: int) -> dict:
    """A streamed `/v1/completions` body (send with `"model"` if the server wants one)."""
    return {"prompt": "the cat and the dog", "n": MAX_N, "logprobs": MAX_LOGPROBS, "max_tokens": max_tokens,
            "ignore_eos": True, "stop": costliest_stop_strings(), "stream": True}
