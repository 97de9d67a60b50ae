"""Schema fuzzing of a live `gracelm serve`: schemathesis reads its `/openapi.json` and runs every phase that
needs no state (the schema's examples, boundary values of each field, then random bodies valid and invalid)
against each route, with the checks that hold the server to its schema: no 5xx, only documented statuses
and content types, bodies (and each streamed event) as documented, schema-violating bodies refused, no
route that takes a request without the API key. Shared by `tests/test_schema_fuzz.py` (tens of examples
per route) and `bench/fuzz.py` (thousands).

A request that gets no answer within `request_timeout` is a hang; one that finds no server, a crash. Both
are counted by kind, beside the failed checks and every 5xx answer.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import httpx
import requests
import schemathesis
from schemathesis.engine import Status, events
from schemathesis.engine.errors import ServerUnavailable

from tests.server_process import metric_value

CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance", "negative_data_rejection",
          "unsupported_method", "ignored_auth"]


@dataclasses.dataclass
class FuzzResult:
    cases: int = 0
    # operation ("POST /v1/completions") -> status -> answers
    statuses: dict[str, collections.Counter[int]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    failures: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    server_errors: list[str] = dataclasses.field(default_factory=list)  # a curl line for each 5xx answer
    examples: dict[str, str] = dataclasses.field(default_factory=dict)  # kind -> one case that shows it
    stopped: str = ""

    @property
    def clean(self) -> bool:
        return not self.failures and not self.server_errors and self.stopped == "completed"

    def report(self) -> str:
        kinds = ", ".join(f"{kind}: {n}" for kind, n in self.failures.most_common()) or "none"
        lines = [f"cases run: {self.cases}", f"5xx found: {len(self.server_errors)}",
                 f"engine stop: {self.stopped}", "answers by operation and status:"]
        lines += [f"  {op}: {dict(sorted(counts.items()))}" for op, counts in sorted(self.statuses.items())]
        lines += [f"failures by kind: {kinds}"]
        lines += [f"  {kind}: {example}" for kind, example in self.examples.items()]
        lines += [f"  5xx: {curl}" for curl in self.server_errors[:10]]
        return "\n".join(lines)

    def _fail(self, kind: str, example: str) -> None:
        self.failures[kind] += 1
        self.examples.setdefault(kind, example[:2000])


def fuzz(url: str, *, max_examples: int, seed: int, request_timeout: float, api_key: str | None = None,
         continue_on_failure: bool = False) -> FuzzResult:
    """Runs the fuzzing against the server at `url` and returns what it found."""
    config = {
        "seed": seed,
        "request-timeout": request_timeout,
        "workers": 1,
        "continue-on-failure": continue_on_failure,
        "generation": {"max-examples": max_examples, "mode": "all", "deterministic": False,
                       "database": "none"},
        "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True},
                   "fuzzing": {"enabled": True}, "stateful": {"enabled": False}},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
        "output": {"sanitization": {"enabled": False}},
        "suppress-health-check": ["all"],
    }
    if api_key is not None:
        config["auth"] = {"openapi": {"APIKey": {"bearer": api_key}}}
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json",
                                           config=schemathesis.Config.from_dict(config))
    result = FuzzResult()
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            _record_scenario(result, event)
        elif isinstance(event, events.NonFatalError):
            result._fail(_network_kind(event.value), f"{event.label}: {event.value!r}")
        elif isinstance(event, events.FatalError):
            result._fail("fatal", repr(event.exception))
        elif isinstance(event, events.EngineFinished):
            result.stopped = event.stop_reason.value
    return result


def _record_scenario(result: FuzzResult, event: events.ScenarioFinished) -> None:
    recorder = event.recorder
    result.cases += len(recorder.cases)
    for case_id, interaction in recorder.interactions.items():
        if interaction.response is None:
            continue
        result.statuses[recorder.label][interaction.response.status_code] += 1
        if interaction.response.status_code >= 500:
            result.server_errors.append(recorder.cases[case_id].value.as_curl_command())
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.status == Status.FAILURE and check.failure_info is not None:
                failure = check.failure_info.failure
                result._fail(check.name, f"{failure.title}: {failure.message} -- "
                                         f"{recorder.cases[case_id].value.as_curl_command()}")


def _network_kind(error: Exception) -> str:
    """A request without an answer: `hang` when it timed out, `no server` when nothing took it."""
    if isinstance(error, requests.Timeout):
        return "hang"
    if isinstance(error, requests.ConnectionError | ServerUnavailable):
        return "no server"
    return f"error {type(error).__name__}"


def wait_idle(url: str, timeout: float = 30) -> bool:
    """Whether, within `timeout`, nothing runs or waits and the KV cache is empty again (a request aborted
    when its client left is freed at the engine's next step, so this may take a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        idle = all(metric_value(text, name) == 0 for name in (
            "gracelm_kv_cache_usage_perc", "gracelm_num_requests_running", "gracelm_num_requests_waiting"))
        if idle or time.monotonic() > deadline:
            return idle
        time.sleep(0.1)
