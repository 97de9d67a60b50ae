"""`gracelm deploy systemd|kubernetes|router [serve options]`: a systemd unit, Kubernetes manifests, or the
command line of a router in front of several servers (`router.py`), made from the same options `gracelm
serve` takes (parsed by the same parser, checked by the same `EngineConfig` and `ServerConfig`), so that
the stop timeouts, probes, watchdog and router health checks cannot disagree with the drain they wait for.
Each number in the output says which flag it comes from; the serve command inside passes the timing flags
explicitly, so the numbers hold even if gracelm's defaults change.

The numbers:
- stop: `--drain-grace-period` + `--shutdown-timeout` + `STOP_MARGIN_S` (the supervisor's bound on the rest
  of a graceful stop) for `TimeoutStopSec` and `terminationGracePeriodSeconds`;
- start: `--expected-load-time` for `TimeoutStartSec` and the startup probe's failure threshold;
- watchdog: pings stop within `WatchdogSec`/2 of a frozen core, whose unanswered liveness probe the server's
  hang path ends after `--engine-hang-timeout` (stacks dumped, requests failed, exit 1); so
  `WatchdogSec` = 2 × the hang timeout + `WATCHDOG_MARGIN_S` lets that path act first, systemd second.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import posixpath
import re
import shlex

import jinja2

from gracelm import options
from gracelm.config import EngineConfig, parse_size
from gracelm.deploy import router
from gracelm.deploy.config import TARGETS, DeployConfig, FleetConfig, KubernetesConfig, RouterConfig
from gracelm.deploy.fleet import Fleet
from gracelm.deploy.templates import KUBERNETES, SYSTEMD
from gracelm.lifecycle.supervisor import STOP_MARGIN_S
from gracelm.serving.server_config import ServerConfig

# Beyond twice the hang timeout: the time the server's own fatal stop takes before systemd's watchdog acts.
WATCHDOG_MARGIN_S = 30.0
# WatchdogSec with the hang path off (--engine-hang-timeout 0): systemd's watchdog is then the only line.
WATCHDOG_WITHOUT_HANG_PATH_S = 60.0
# Kubernetes: how often the startup and readiness probes ask /ready.
PROBE_PERIOD_S = 5
# Kubernetes: the grace period when none is given: endpoint removal reaches kube-proxy and ingresses while
# the pod still accepts (what a preStop sleep would do, with /ready already 503).
KUBERNETES_DRAIN_GRACE_S = 5.0
_TIMING_FLAGS = ("drain_grace_period", "shutdown_timeout", "engine_hang_timeout")
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
_LOOPBACK = ("127.", "localhost", "::1")




def render(target: str, args: argparse.Namespace) -> str:
    """The file(s) for `target` from parsed `gracelm deploy` arguments; `ValueError` names what cannot be
    deployed as given."""
    deploy = options.from_args(TARGETS[target], args)
    given = vars(args)
    overrides: dict[str, object] = {}
    if target == "kubernetes":
        overrides = _kubernetes_overrides(given, deploy)
    if target == "router":
        overrides = _router_overrides(given)
    # The key is never written into a file (`_refuse`).
    engine, server = _serve_configs(args, overrides, api_key=[])
    _refuse(target, given, engine, server)
    flags = _serve_flags(given, engine, server, overrides)
    if isinstance(deploy, RouterConfig):
        return _router_script(deploy, flags, _command_line(target, given, deploy, flags))
    values = _numbers(engine, server, deploy)
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                                     keep_trailing_newline=True, autoescape=False)
    context = {**values, "deploy": deploy, "engine": engine, "server": server, "flags": flags,
               "command": _command_line(target, given, deploy, flags)}
    writable = _writable_paths(engine, server)
    if target == "systemd":
        template = environment.from_string(SYSTEMD)
        words = [f"{_systemd_word(deploy.exec_path)} serve", *(_systemd_word(w) for w in flags)]
        context |= {"exec_start": " \\\n    ".join(words), "writable": writable}
    else:
        template = environment.from_string(KUBERNETES)
        context |= {"writable": [(f"writable-{i}", path) for i, path in enumerate(writable)],
                    "kv_cache_dir_bytes": parse_size(engine.kv_cache_dir_size),
                    **_kubernetes_router(deploy, server)}
    return template.render(context)


def _serve_configs(args: argparse.Namespace, overrides: dict[str, object],
                   **server_fields: object) -> tuple[EngineConfig, ServerConfig]:
    """`serve`'s configurations from the arguments, with the target's overrides."""
    engine = options.from_args(EngineConfig, args, **{k: v for k, v in overrides.items()
                                                        if k in _fields(EngineConfig)})
    server = options.from_args(ServerConfig, args, **server_fields,
                               **{k: v for k, v in overrides.items() if k in _fields(ServerConfig)})
    return engine, server


def _fields(cls: type) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


def _kubernetes_overrides(given: dict, deploy: KubernetesConfig) -> dict[str, object]:
    """What a pod needs that `serve`'s defaults would not give: listening on the pod's IP, a grace period
    for endpoint removal, threads matching the CPU limit (the CPUs a container sees are the node's), and
    behind a router (`--router`), its health checks out of the access log."""
    overrides = _router_overrides(given) if deploy.router != "none" else {}
    if "host" not in given:
        overrides["host"] = "0.0.0.0"
    if "drain_grace_period" not in given:
        overrides.setdefault("drain_grace_period", KUBERNETES_DRAIN_GRACE_S)
    if "num_threads" not in given:
        overrides["num_threads"] = max(1, deploy.cpus // given.get("tensor_parallel_size", 1))
    return overrides


def fleet(args: argparse.Namespace) -> Fleet:
    """`gracelm fleet`'s workers and router, from its parsed arguments (`ValueError` as `render`)."""
    deploy = options.from_args(FleetConfig, args)
    given = vars(args)
    overrides = _router_overrides(given)
    engine, server = _serve_configs(args, overrides)
    # The fleet's --host and --port are the router's; each worker gets its own.
    flags = [word for word in _serve_flags(given, engine, server, overrides)
             if not word.startswith(("--host=", "--port="))]
    return Fleet(flags, deploy.replicas, server.host, server.port, deploy.router, deploy.policy,
                 deploy.expected_load_time)


def _kubernetes_router(deploy: KubernetesConfig, server: ServerConfig) -> dict[str, object]:
    """The router Deployment's command, arguments and why each has its value (`--router`)."""
    if deploy.router == "none":
        return {}
    pods = {"app.kubernetes.io/name": "gracelm", "app.kubernetes.io/instance": deploy.name}
    flags = router.router_flags("0.0.0.0", deploy.router_port, router.discovered(pods, server.port),
                                deploy.policy)
    return {"router_command": router.COMMANDS[deploy.router], "router_flags": flags,
            "router_args": router.arguments(flags)}


def _router_overrides(given: dict) -> dict[str, object]:
    """Workers behind a router keep serving until the router has taken them out of rotation, and leave its
    health checks, one a second, out of their access logs."""
    overrides: dict[str, object] = {}
    if "disable_access_log_for_endpoints" not in given:
        overrides["disable_access_log_for_endpoints"] = [router.HEALTH_ENDPOINT]
    if "drain_grace_period" in given:
        router.check_grace(given["drain_grace_period"])
    else:
        overrides["drain_grace_period"] = router.router_grace()
    return overrides


def _router_script(deploy: RouterConfig, serve_flags: list[str], generated_by: str) -> str:
    if not deploy.worker_url:
        raise ValueError("--worker-url: give the URL of each gracelm worker")
    flags = router.router_flags(deploy.router_host, deploy.router_port, router.listed(deploy.worker_url),
                                deploy.policy)
    header = [f"Generated by: {generated_by}",
              "Each worker runs, with these timing flags (--drain-grace-period matched to the router):",
              f"  gracelm serve {shlex.join(serve_flags)}",
              "Each flag of the router below says why it has its value; regenerate rather than edit."]
    return router.script(deploy.router, flags, header)


def _refuse(target: str, given: dict, engine: EngineConfig, server: ServerConfig) -> None:
    if "api_key" in given:
        raise ValueError("--api-key would be written into the file: set GRACELM_API_KEY instead (systemd: in "
                         "the unit's EnvironmentFile; Kubernetes: the Secret's key api-key)")
    if engine.nnodes > 1:
        raise ValueError("--nnodes > 1: a deployment over several machines is not generated")
    paths = {"model": engine.model, "kv_cache_dir": engine.kv_cache_dir,
             "shutdown_report": engine.shutdown_report, "state_dir": server.state_dir}
    for name, path in paths.items():
        if path is not None and not posixpath.isabs(path):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {path!r} must be an absolute path: the service does not run in this "
                             f"directory")
    if target == "kubernetes":
        routed = [flag for flag in ("policy", "router_port") if flag in given]
        if routed and given.get("router", "none") == "none":
            raise ValueError(f"--{routed[0].replace('_', '-')} is for the router: add --router vllm|sglang")
        if server.port == 0:
            raise ValueError("--port 0: the probes and the Service need a fixed port")
        if server.host.startswith(_LOOPBACK):
            raise ValueError(f"--host {server.host}: the probes and the Service reach the pod on its own IP")


def _serve_flags(given: dict, engine: EngineConfig, server: ServerConfig,
                 overrides: dict[str, object]) -> list[str]:
    """The serve command's arguments: every option given (or set for the target), and the timing flags
    always, with their values."""
    flags = [engine.model] if engine.model is not None else []
    for config in (engine, server):
        for field in dataclasses.fields(config):
            name = field.name
            if name == "model" or not field.metadata.get("cli", False):
                continue
            if name in given or name in overrides or name in _TIMING_FLAGS:
                flags += _flag(name, getattr(config, name))
    return flags


def _flag(name: str, value: object) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, list):
        return [f"{flag}={item}" for item in value]
    return [f"{flag}={_number(value) if isinstance(value, float) else value}"]


def _number(value: float) -> str:
    return f"{value:g}"


def _writable_paths(engine: EngineConfig, server: ServerConfig) -> list[str]:
    """Directories the server writes outside its runtime and cache directories."""
    paths = [server.state_dir] if server.state_dir is not None else []
    if engine.kv_cache_dir is not None:
        paths.append(engine.kv_cache_dir)
    if engine.shutdown_report is not None:
        paths.append(posixpath.dirname(engine.shutdown_report))
    return paths


def _numbers(engine: EngineConfig, server: ServerConfig, deploy: DeployConfig) -> dict[str, object]:
    stop = server.drain_grace_period + engine.shutdown_timeout + STOP_MARGIN_S
    hang = engine.engine_hang_timeout
    watchdog = 2 * hang + WATCHDOG_MARGIN_S if hang > 0 else WATCHDOG_WITHOUT_HANG_PATH_S
    return {
        "grace": _number(server.drain_grace_period), "shutdown_timeout": _number(engine.shutdown_timeout),
        "hang_timeout": _number(hang), "stop_margin": _number(STOP_MARGIN_S),
        "watchdog_margin": _number(WATCHDOG_MARGIN_S),
        "load_time": _number(deploy.expected_load_time),
        "timeout_start_sec": math.ceil(deploy.expected_load_time),
        "timeout_stop_sec": math.ceil(stop),
        "watchdog_sec": math.ceil(watchdog),
        "probe_period": PROBE_PERIOD_S,
        "startup_failures": math.ceil(deploy.expected_load_time / PROBE_PERIOD_S),
    }


def _command_line(target: str, given: dict, deploy: DeployConfig | RouterConfig, flags: list[str]) -> str:
    deploy_flags = [w for field in dataclasses.fields(deploy) if field.name in given
                    for w in _flag(field.name, getattr(deploy, field.name))]
    return " ".join(["gracelm deploy", target, *deploy_flags, *flags])


def _systemd_word(word: str) -> str:
    """One word of ExecStart: `%` and `$` escaped, quoted when it holds anything but plain characters."""
    escaped = word.replace("%", "%%").replace("$", "$$")
    if _PLAIN_WORD.fullmatch(word):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'
