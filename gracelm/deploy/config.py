"""The options of `gracelm deploy` beyond `serve`'s, per target (declared once, as `gracelm.options` does);
kept apart from `deploy.py` so that building the command line imports no template engine."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gracelm.options import at_least, in_range, option, validate

_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


def _quantity(value: str) -> str | None:
    return None if _QUANTITY.fullmatch(value) else f"is not a Kubernetes quantity such as 8Gi, got {value!r}"


@dataclass
class DeployConfig:
    name: str = option("gracelm", "name of the unit / the Kubernetes objects")
    expected_load_time: float = option(120.0, "seconds a start may take until /ready answers 200",
                                       check=at_least(1))

    def __post_init__(self) -> None:
        validate(self)


@dataclass
class SystemdConfig(DeployConfig):
    user: str = option("gracelm", "user (and group) the service runs as")
    exec_path: str = option("/opt/gracelm/.venv/bin/gracelm", "absolute path of the gracelm command on the "
                                                              "target machine")


ROUTERS = ["vllm", "sglang"]
POLICIES = ["cache_aware", "round_robin", "random", "power_of_two"]
_ROUTER_HELP = "the router: vllm-router or sglang-router (both from PyPI)"
_POLICY_HELP = "how the router picks a worker (the routers' default: cache_aware)"


@dataclass
class KubernetesConfig(DeployConfig):
    image: str = option("gracelm:latest", "container image with gracelm (on PATH) and the model")
    replicas: int = option(2, "pods of the Deployment", check=at_least(1))
    cpus: int = option(4, "CPUs each pod requests and is limited to; also its --num-threads unless given",
                       check=at_least(1))
    memory: str = option("8Gi", "memory each pod requests and is limited to", check=_quantity)
    router: str = option("none", f"{_ROUTER_HELP}, as a Deployment of its own in front of the pods (none: "
                                 f"the Service alone)", choices=["none", *ROUTERS])
    policy: str = option("cache_aware", _POLICY_HELP, choices=POLICIES)
    router_port: int = option(8080, "port of the router's Service", check=in_range(1, 65535))
    inference_pool: bool = option(False, "a Gateway API Inference Extension InferencePool of the pods, for "
                                         "its endpoint picker (installed apart, named NAME-epp)")


@dataclass
class RouterChoice:
    router: str = option("vllm", _ROUTER_HELP, choices=ROUTERS)
    policy: str = option("cache_aware", _POLICY_HELP, choices=POLICIES)

    def __post_init__(self) -> None:
        validate(self)


@dataclass
class RouterConfig(RouterChoice):
    worker_url: list[str] = option([], "URL of a gracelm worker (repeat for each; at least one)")
    router_host: str = option("127.0.0.1", "address the router binds")
    router_port: int = option(8080, "port the router binds", check=in_range(1, 65535))


@dataclass
class FleetConfig(RouterChoice):
    replicas: int = option(2, "gracelm workers behind the router, on --port + 1 and on", check=at_least(1))
    expected_load_time: float = option(120.0, "seconds a worker's start may take until /ready answers 200",
                                       check=at_least(1))


TARGETS = {"systemd": SystemdConfig, "kubernetes": KubernetesConfig, "router": RouterConfig}
