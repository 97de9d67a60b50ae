"""What one request may cost the server, beyond what `SamplingParams` bounds for every engine (`n` ≤ 128,
`logprobs` ≤ 20) and the body size (`--max-request-body-bytes`): its stop strings, in number and in total
length. Each refusal is a 400 naming the option that sets the limit.

Why these bounds: stop strings are matched in the server's event loop for each of the `n` completions after
each token. The matching reads each new character once whatever the stop strings are
(`engine/stop_strings.py`), but building their automaton, and keeping it, grows with their total length.
"""

from __future__ import annotations

from dataclasses import dataclass

from gracelm.serving.api_errors import APIError


@dataclass(frozen=True)
class RequestLimits:
    max_stop_strings: int
    max_stop_chars: int

    def check_stop(self, stop: list[str]) -> None:
        if len(stop) > self.max_stop_strings:
            raise _refused(f"{len(stop)} stop strings exceed this server's limit of {self.max_stop_strings}",
                           "--max-stop-strings")
        total = sum(len(s) for s in stop)
        if total > self.max_stop_chars:
            raise _refused(f"the stop strings' {total} characters exceed this server's limit of "
                           f"{self.max_stop_chars}", "--max-stop-chars")


def _refused(what: str, option: str) -> APIError:
    return APIError(400, f"stop: {what} (set by {option})", param="stop", code="limit_exceeded")
