"""The field's routers in front of gracelm workers: vllm-router's and sglang-router's command line, with
the health checks and circuit breaker matched to the workers' drain, so that a rolling restart loses
nothing (docs/deployment.md, "Behind a router").

The drain a router sees (docs/lifecycle.md): SIGTERM turns `/ready` 503 at once while the worker still
serves for `--drain-grace-period`, then refuses new requests with 503. So the router polls `/ready`, often
and cheaply, and must have taken the worker out of rotation before the grace period ends: that takes at
most `HEALTH_INTERVAL_S` × `HEALTH_FAILURES` plus one check's `HEALTH_TIMEOUT_S`, and the grace period
is that and `GRACE_MARGIN_S` more (`router_grace`). A restarted worker is back in rotation
`HEALTH_SUCCESSES` checks after its `/ready` turns 200. The routers' circuit breakers open on failed
requests, which a worker only gives when it dies; an open breaker is tried again after `BREAKER_OPEN_S`,
no later than the health checks would readmit the worker, instead of the routers' default 60 s, which left
a restarted worker idle for a minute and, with the second worker restarted inside it, no worker at all.
"""

from __future__ import annotations

import math
import shlex

HEALTH_ENDPOINT = "/ready"
HEALTH_INTERVAL_S = 1
HEALTH_FAILURES = 2
HEALTH_SUCCESSES = 2
HEALTH_TIMEOUT_S = 2
GRACE_MARGIN_S = 1
BREAKER_OPEN_S = HEALTH_INTERVAL_S * HEALTH_SUCCESSES

# Each router's command; both take the same flags.
COMMANDS = {"vllm": ["vllm-router"], "sglang": ["sglang-router", "launch"]}


def removal_time() -> float:
    """The longest a router takes to stop sending a draining worker new requests."""
    return HEALTH_INTERVAL_S * HEALTH_FAILURES + HEALTH_TIMEOUT_S


def router_grace() -> float:
    """The `--drain-grace-period` the workers need behind a router."""
    return removal_time() + GRACE_MARGIN_S


def readmission_time() -> float:
    """The longest a worker waits, once ready, to be back in rotation."""
    return HEALTH_INTERVAL_S * HEALTH_SUCCESSES + HEALTH_TIMEOUT_S


def check_grace(grace_period: float) -> None:
    """`ValueError` when the workers' grace period ends before a router has taken them out of rotation."""
    if grace_period < removal_time():
        raise ValueError(f"--drain-grace-period {grace_period:g} is shorter than the {removal_time():g} s a "
                         f"router takes to stop sending a draining worker requests; use at least "
                         f"{math.ceil(router_grace())}")


def listed(urls: list[str]) -> tuple[list[str], str]:
    """The workers, by URL."""
    return ["--worker-urls", *urls], "the gracelm workers"


def discovered(labels: dict[str, str], port: int) -> tuple[list[str], str]:
    """The workers, found as the Kubernetes pods of these labels in the router's own namespace (the
    variable `POD_NAMESPACE`, which Kubernetes expands in a container's arguments)."""
    words = ["--service-discovery", "--selector", *(f"{k}={v}" for k, v in labels.items()),
             "--service-discovery-port", str(port), "--service-discovery-namespace", "$(POD_NAMESPACE)"]
    return words, "the gracelm pods, by their labels, in this namespace"


def router_flags(host: str, port: int, workers: tuple[list[str], str],
                 policy: str) -> list[tuple[list[str], str]]:
    """The router's arguments, each with why it has its value."""
    return [
        (["--host", host, "--port", str(port)], "where the router listens"),
        workers,
        (["--policy", policy], "how a request picks its worker"),
        (["--health-check-endpoint", HEALTH_ENDPOINT],
         "503 from the first moment of a worker's drain, 200 once it serves"),
        (["--health-check-interval-secs", str(HEALTH_INTERVAL_S)], "a /ready check costs nothing"),
        (["--health-failure-threshold", str(HEALTH_FAILURES)],
         f"out of rotation within {removal_time():g} s of a drain, inside its grace period"),
        (["--health-success-threshold", str(HEALTH_SUCCESSES)],
         f"back in rotation within {readmission_time():g} s of ready"),
        (["--health-check-timeout-secs", str(HEALTH_TIMEOUT_S)], "a worker that cannot answer /ready in "
                                                                 "time counts as not ready"),
        (["--cb-timeout-duration-secs", str(BREAKER_OPEN_S)],
         "an open circuit breaker retries its worker as soon as the health checks would"),
    ]


def arguments(flags: list[tuple[list[str], str]]) -> list[str]:
    return [word for words, _ in flags for word in words]


def command(router: str, flags: list[tuple[list[str], str]]) -> list[str]:
    return [*COMMANDS[router], *arguments(flags)]


def script(router: str, flags: list[tuple[list[str], str]], header: list[str]) -> str:
    """A shell script that runs the router: each flag on its own line, why above it."""
    lines = ["#!/bin/sh", *(f"# {line}" for line in header), "#"]
    lines += [f"# {' '.join(words[:1])}: {why}" for words, why in flags]
    body = [shlex.join(COMMANDS[router])] + [shlex.join(words) for words, _ in flags]
    lines.append("exec " + " \\\n    ".join(body))
    return "\n".join(lines) + "\n"
