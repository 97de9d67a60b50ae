"""Whether what a start is about to allocate fits in the memory this process may use, checked before it is
allocated: a start that cannot fit fails at once with exit 3 and says what would fit, instead of being
OOM-killed halfway through loading, or at the first busy minute when the KV cache's pages are touched.

The memory available is the smaller of the host's (`MemAvailable`: free memory and what the kernel can
reclaim) and, inside a memory cgroup (a container, a systemd unit with `MemoryMax=`), the cgroup's limit less
what it holds now, its reclaimable page cache excepted. Both cgroup versions are read, and a limit set on a
parent cgroup counts as well.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Above this a cgroup's limit means "none" (v1 writes the largest page-aligned 64-bit value).
_NO_LIMIT = 1 << 62


class MemoryBudgetError(RuntimeError):
    """What a start needs does not fit in the memory available; the message says what would."""


@dataclass(frozen=True)
class Available:
    bytes: int
    source: str  # "the host" or the cgroup's path and limit: where the bound comes from, for the message


def available_memory() -> Available:
    host = Available(psutil.virtual_memory().available, "the host")
    cgroup = cgroup_available()
    return cgroup if cgroup is not None and cgroup.bytes < host.bytes else host


def require(need: int, what: str, advice: str, available: Available | None = None) -> None:
    """Raises `MemoryBudgetError` when `need` bytes (for `what`) exceed `available` (by default the memory
    available now)."""
    available = available or available_memory()
    if need > available.bytes:
        raise MemoryBudgetError(f"{what} need {gib(need)}, and {gib(available.bytes)} is available "
                                f"({available.source}): {advice}")
    logger.info("%s: %s of %s available (%s)", what, gib(need), gib(available.bytes), available.source)


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def cgroup_available() -> Available | None:
    """The memory this process's cgroup may still take, or None outside a limited memory cgroup."""
    for read in (_cgroup_v2, _cgroup_v1):
        try:
            found = read()
        except (OSError, ValueError):  # a cgroup file missing or unreadable: that version does not apply
            continue
        if found is not None:
            return found
    return None


def own_cgroup(controller: str) -> str | None:
    """This process's cgroup path in the hierarchy of `controller` ("" for cgroup v2's unified one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


def _cgroup_v2() -> Available | None:
    path = own_cgroup("")
    if path is None:
        return None
    folder = CGROUP_ROOT / path.lstrip("/")
    if not (folder / "memory.max").exists():
        return None
    limits = []
    for level in [folder, *folder.parents]:  # the tightest of this cgroup's and its ancestors' limits
        if level == CGROUP_ROOT.parent or not (level / "memory.max").exists():
            break
        value = (level / "memory.max").read_text().strip()
        if value != "max":
            limits.append((int(value) - _used(level, "memory.current", "inactive_file"), level))
    return _tightest(limits)


def _cgroup_v1() -> Available | None:
    path = own_cgroup("memory")
    if path is None:
        return None
    folder = CGROUP_ROOT / "memory" / path.lstrip("/")
    stat = _stat(folder)
    limit = stat.get("hierarchical_memory_limit", int((folder / "memory.limit_in_bytes").read_text()))
    if limit >= _NO_LIMIT:
        return None
    return _tightest([(limit - _used(folder, "memory.usage_in_bytes", "total_inactive_file"), folder)])


def _tightest(limits: list[tuple[int, Path]]) -> Available | None:
    if not limits:
        return None
    left, folder = min(limits)
    return Available(max(0, left), f"memory cgroup {folder}")


def _used(folder: Path, usage_file: str, reclaimable: str) -> int:
    """What the cgroup holds, less the page cache it can drop."""
    return int((folder / usage_file).read_text()) - _stat(folder).get(reclaimable, 0)


def _stat(folder: Path) -> dict[str, int]:
    lines = (folder / "memory.stat").read_text().splitlines()
    return {name: int(value) for name, value in (line.split() for line in lines)}
