"""The options of `gracelm deploy` beyond `serve`'s, per target (declared once, as `gracelm.options` does);
kept apart from `deploy.py` so that building the command line imports no template engine."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gracelm.options import at_least, option, validate

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


@dataclass
class KubernetesConfig(DeployConfig):
    image: str = option("gracelm:latest", "container image with gracelm (on PATH) and the model")
    replicas: int = option(2, "pods of the Deployment", check=at_least(1))
    cpus: int = option(4, "CPUs each pod requests and is limited to; also its --num-threads unless given",
                       check=at_least(1))
    memory: str = option("8Gi", "memory each pod requests and is limited to", check=_quantity)


TARGETS = {"systemd": SystemdConfig, "kubernetes": KubernetesConfig}
