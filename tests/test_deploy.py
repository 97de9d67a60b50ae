"""`gracelm deploy systemd|kubernetes`, run as a command: the files in deploy/ are its default output; the
Kubernetes objects validate against the Kubernetes schemas (kubernetes-validate, offline, strict: unknown
fields are errors); the unit passes `systemd-analyze verify`; the times in both agree with the flags, and
the serve command inside each parses back, with the same parser, to the options given."""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gracelm import options
from gracelm.cli.main import build_parser
from gracelm.config import EngineConfig
from gracelm.deploy import router
from gracelm.lifecycle.supervisor import STOP_MARGIN_S
from gracelm.serving.server_config import ServerConfig

GRACELM = Path(sys.executable).parent / "gracelm"
DEPLOY_DIR = Path(__file__).resolve().parent.parent / "deploy"
SERVE_OPTIONS = ["/srv/models/tiny model.gguf", "--port", "9000", "--drain-grace-period", "7",
                 "--shutdown-timeout", "45", "--engine-hang-timeout", "20",
                 "--kv-cache-dir", "/var/lib/gracelm/kv",
                 "--kv-cache-dir-size", "1GiB", "--shutdown-report", "/var/log/gracelm/report.json",
                 "--max-num-seqs", "8", "--enable-prefix-caching", "--state-dir", "/var/lib/gracelm/state"]


def deploy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(GRACELM), "deploy", *args], capture_output=True, text=True, timeout=60)


def generated(*args: str) -> str:
    result = deploy(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def serve_options(words: list[str]) -> tuple[EngineConfig, ServerConfig]:
    """The options a `gracelm serve` with these arguments runs with, read by gracelm's own parser."""
    args = build_parser().parse_args(["serve", *words])
    if args.model_path is not None:
        args.model = args.model_path
    return options.from_args(EngineConfig, args), options.from_args(ServerConfig, args)


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as systemd reads it: continuation lines joined, comments dropped, repeated keys kept."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, value = line.split("=", 1)
        current.setdefault(key, []).append(value)
    return sections


def test_deploy_dir_holds_the_default_outputs():
    for target, name in (("systemd", "gracelm.service"), ("kubernetes", "kubernetes.yaml")):
        assert generated(target) == (DEPLOY_DIR / name).read_text(), (
            f"deploy/{name} is not what `gracelm deploy {target}` prints now; regenerate it: "
            f".venv/bin/gracelm deploy {target} > deploy/{name}")


@pytest.mark.parametrize("args", [[], SERVE_OPTIONS + ["--cpus", "8", "--memory", "16Gi", "--replicas", "3",
                                                       "--name", "chat", "--expected-load-time", "300"]],
                         ids=["defaults", "options"])
def test_kubernetes_objects_validate_and_their_numbers_come_from_the_flags(args):
    docs = list(yaml.safe_load_all(generated("kubernetes", *args)))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "PodDisruptionBudget"]
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    deployment, service, budget = docs
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    engine, server = serve_options(container["args"])
    assert container["command"] == ["gracelm", "serve"]
    assert server.host == "0.0.0.0"
    assert pod["terminationGracePeriodSeconds"] == math.ceil(server.drain_grace_period
                                                             + engine.shutdown_timeout + STOP_MARGIN_S)
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    port = container["ports"][0]["containerPort"]
    assert port == server.port and service["spec"]["ports"][0]["port"] == server.port
    startup = container["startupProbe"]
    load = 300 if args else 120
    assert startup["periodSeconds"] * startup["failureThreshold"] >= load
    assert budget["spec"]["maxUnavailable"] == 1
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector == budget["spec"]["selector"]["matchLabels"]
    resources = container["resources"]
    if not args:
        assert server.drain_grace_period == 5 and engine.num_threads == 4
        assert resources["limits"] == {"cpu": "4", "memory": "8Gi"}
        return
    assert (server.drain_grace_period, engine.shutdown_timeout, engine.engine_hang_timeout) == (7, 45, 20)
    assert pod["terminationGracePeriodSeconds"] == 7 + 45 + STOP_MARGIN_S
    assert engine.model == "/srv/models/tiny model.gguf" and engine.max_num_seqs == 8
    assert engine.enable_prefix_caching is True and engine.num_threads == 8
    assert resources["requests"] == resources["limits"] == {"cpu": "8", "memory": "16Gi"}
    assert deployment["spec"]["replicas"] == 3 and deployment["metadata"]["name"] == "chat"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/var/lib/gracelm/kv"]]["emptyDir"]["sizeLimit"] == str(1 << 30)
    assert "/var/log/gracelm" in mounts and "/var/lib/gracelm/state" in mounts


def test_systemd_unit_parses_its_times_agree_with_the_flags_and_systemd_analyze_verifies_it(tmp_path):
    unit = generated("systemd", *SERVE_OPTIONS, "--expected-load-time", "200", "--exec-path", str(GRACELM))
    service = parse_unit(unit)["Service"]
    single = {key: values[-1] for key, values in service.items()}
    words = [w.replace("%%", "%") for w in shlex.split(single["ExecStart"])]
    assert words[:2] == [str(GRACELM), "serve"]
    engine, server = serve_options(words[2:])
    assert engine.model == "/srv/models/tiny model.gguf" and server.port == 9000
    assert (server.drain_grace_period, engine.shutdown_timeout, engine.engine_hang_timeout) == (7, 45, 20)
    assert int(single["TimeoutStopSec"]) == math.ceil(7 + 45 + STOP_MARGIN_S)
    assert int(single["TimeoutStartSec"]) == 200
    assert int(single["WatchdogSec"]) == 2 * 20 + 30
    assert single["Type"] == "notify" and single["NotifyAccess"] == "main" and single["KillMode"] == "mixed"
    assert single["Restart"] == "on-failure" and single["RestartPreventExitStatus"] == "2 3"
    assert single["NoNewPrivileges"] == "yes" and single["ProtectSystem"] == "strict"
    assert single["PrivateTmp"] == "yes" and single["RuntimeDirectory"] == "gracelm"
    assert service["ReadWritePaths"] == ["/var/lib/gracelm/state", "/var/lib/gracelm/kv", "/var/log/gracelm"]
    assert server.state_dir == "/var/lib/gracelm/state"
    assert "XDG_RUNTIME_DIR=%t/gracelm" in service["Environment"]
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not on this machine")
    path = tmp_path / "gracelm-test.service"
    path.write_text(unit)
    verify = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert verify.returncode == 0 and verify.stderr == "" and verify.stdout == "", verify


def test_the_hang_path_off_leaves_systemds_watchdog_alone_in_charge():
    service = parse_unit(generated("systemd", "--engine-hang-timeout", "0"))["Service"]
    assert service["WatchdogSec"] == ["60"]


@pytest.mark.parametrize(("args", "says"), [
    (["systemd", "--api-key", "secret"], "--api-key would be written into the file"),
    (["kubernetes", "--host", "127.0.0.1"], "--host 127.0.0.1"),
    (["kubernetes", "--port", "0"], "--port 0"),
    (["systemd", "--kv-cache-dir", "kv"], "--kv-cache-dir 'kv' must be an absolute path"),
    (["systemd", "relative/model"], "--model 'relative/model' must be an absolute path"),
    (["kubernetes", "--state-dir", "state"], "--state-dir 'state' must be an absolute path"),
    (["kubernetes", "--memory", "lots"], "memory is not a Kubernetes quantity"),
    (["systemd", "--shutdown-timeout", "-1"], "shutdown_timeout must be at least 0"),
    (["kubernetes", "--nnodes", "2", "--dist-init-addr", "h:1"], "--nnodes > 1"),
])
def test_what_cannot_be_deployed_is_a_usage_error_naming_it(args, says):
    result = deploy(*args)
    assert result.returncode == 2 and says in result.stderr and result.stdout == "", result


@pytest.mark.parametrize("which", ["vllm", "sglang"])
def test_a_router_in_front_of_the_pods_and_an_inference_pool_validate_and_follow_the_drain(which):
    docs = list(yaml.safe_load_all(generated("kubernetes", "/srv/models/m.gguf", "--router", which,
                                             "--policy", "round_robin", "--inference-pool")))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding",
                     "Deployment", "Service", "InferencePool"]
    for doc in docs[:-1]:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    workers, router_deployment, pool = docs[0], docs[6], docs[8]
    engine, server = serve_options(workers["spec"]["template"]["spec"]["containers"][0]["args"])
    assert server.drain_grace_period >= router.removal_time()
    assert server.quiet_paths == ["/ready"]  # the router's checks, one a second, out of the access log
    (container,) = router_deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == router.COMMANDS[which]
    parsed = _router_args(which, container["args"])
    pods = workers["spec"]["selector"]["matchLabels"]
    assert parsed.service_discovery and parsed.selector == pods
    assert parsed.service_discovery_port == server.port
    assert (parsed.health_check_endpoint, parsed.policy) == ("/ready", "round_robin")
    assert (parsed.health_check_interval_secs * parsed.health_failure_threshold
            + parsed.health_check_timeout_secs) <= server.drain_grace_period
    assert router_deployment["spec"]["template"]["metadata"]["labels"] != pods  # not a worker itself
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"] == pods
    assert pool["spec"]["targetPorts"] == [{"number": server.port}]
    assert pool["spec"]["endpointPickerRef"]["name"] == "gracelm-epp"


def _router_args(which: str, args: list[str]):
    """The arguments as the router itself reads them (its own parser, from its PyPI package)."""
    if which == "vllm":
        from vllm_router.launch_router import parse_router_args
    else:
        from sglang_router.launch_router import parse_router_args
    return parse_router_args(args)


def test_a_router_script_parses_as_the_router_reads_it():
    script = generated("router", "/srv/models/m.gguf", "--worker-url", "http://10.0.0.1:8000",
                       "--worker-url", "http://10.0.0.2:8000", "--router", "sglang")
    words = shlex.split(script.split("exec ", 1)[1].replace("\\\n", " "))
    assert words[:2] == router.COMMANDS["sglang"]
    parsed = _router_args("sglang", words[2:])
    assert parsed.worker_urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert parsed.cb_timeout_duration_secs == router.BREAKER_OPEN_S
    serve = shlex.split(re.search(r"#   gracelm serve (.*)", script).group(1))
    _, server = serve_options(serve)
    assert server.drain_grace_period == router.router_grace()


@pytest.mark.parametrize(("args", "says"), [
    (["--policy", "random"], "--policy is for the router"),
    (["--router", "vllm", "--drain-grace-period", "1"], "--drain-grace-period 1 is shorter"),
])
def test_router_options_that_cannot_be_honoured_are_refused(args, says):
    result = deploy("kubernetes", "/srv/models/m.gguf", *args)
    assert result.returncode == 2 and says in result.stderr, result.stderr

