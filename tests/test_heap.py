"""The model process's heap policy (`gracelm/lifecycle/heap.py`, applied by each worker at start): after
`keep_freed_memory`, a step's megabyte tensors freed and allocated again reuse mapped pages instead of
faulting fresh zeroed ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Runs 50 "steps" after a warm-up, each holding a few megabyte tensors at once (12 to 32 rows of logits,
# float32, and what sampling makes of them; the rows vary as a server's steps do) and freeing them, and
# prints the minor page faults those 50 took. With glibc's defaults the count varies from run to run
# (its mmap threshold adapts to what is freed, in arenas that torch's threads pick): 1,440 to 111,264
# measured. The control pins that threshold at glibc's starting 128 KiB, so that every step's tensors
# are fresh mmaps: 338,028 every time. The policy leaves a stray growth of the heap: 1,152 to 1,920.
PROBE = """
import resource, sys, torch
from gracelm.lifecycle.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step(rows):
    logits = torch.ones(rows, 49152)
    probs = logits.softmax(-1)
    ranked = probs.sort(-1, descending=True)
    return float(ranked.values[:, 0].sum() + logits.log_softmax(-1)[:, 0].sum())
for rows in (32, 20, 28, 12) * 2:
    step(rows)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(50):
    step((32, 20, 28, 12)[i % 4])
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(policy: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, policy], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_step_memory_is_reused_without_page_faults() -> None:
    control = faults("default", {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    kept = faults("keep", {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})  # the policy overrides the pin
    assert control > 50 * 4000, control  # the probe sees every step's pages fault
    assert kept * 50 < control, (kept, control)  # at most a stray growth of the heap, not every step's
