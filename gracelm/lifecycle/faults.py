"""TEST-ONLY fault injection: one typed object, read once per process from the environment, never set in
production. Product code calls `faults()`'s methods at the points where a test needs a fault; without
`GRACELM_TEST_HOOKS` every method does nothing.

`GRACELM_TEST_HOOKS` holds a JSON object whose keys are the faults below. Children inherit the variable, so
a test sets it around the start of a server or an engine and the faults reach the engine core and its
workers without passing through any configuration. A key not in this list, a value of the wrong type or a
variable that is not a JSON object refuses the start (`FaultsError`; `gracelm serve` exits 2 naming it): a
misspelled fault must never pass silently as a test that proves nothing.

The faults (the one list):
- `test_slow_load_s`: the engine core sleeps this long before it loads the model (`before_model_load`).
- `test_step_sleep_s`: the engine core sleeps this long after every step (`after_core_step`).
- `test_raise_after_steps`, `test_exit_after_steps`, `test_hang_after_steps`: once the engine core has run
  that many steps, it raises, exits at once with code 5 (`os._exit`), or hangs for ever (`after_core_step`).
- `test_worker_raise_after_steps`, `test_worker_hang_after_steps`: the same for a tensor-parallel worker,
  raise or hang (`after_worker_step`).
- `test_raise_in_sampling_for_seed`: sampling raises for the rows of requests with that seed, so that a test
  can show that only those requests fail; `test_exit_for_seed`: the process exits at once (code 5) at a step
  with such a request, work that kills the server (`in_sampling`).
- `test_kv_snapshot_block_sleep_s`: a KV-cache snapshot writes each block this much slower, so that a test
  can kill the core half-way through a save (`kv_block_delay`); `test_exit_in_kv_restore`: the core exits
  (code 5) while it restores its snapshot (`in_kv_restore`).
- `test_journal_commit_sleep_s`: each batch-journal transaction waits this long before its COMMIT, so that
  a test's kill lands inside open transactions (`before_journal_commit`).
- `test_batch_completion_window_s`: a new batch's completion window, in seconds, instead of 24 h
  (`batch_completion_window_s`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable

ENV = "GRACELM_TEST_HOOKS"
EXIT_CODE = 5  # a fault's own exit, told apart from every exit code of `exit_codes.py`

logger = logging.getLogger(__name__)


class FaultsError(ValueError):
    """`GRACELM_TEST_HOOKS` names a fault that does not exist, or gives one a value of the wrong type."""


@dataclasses.dataclass(frozen=True)
class FaultInjector:
    """The faults of this process; the field `x` is the key `test_x` (module docstring)."""

    slow_load_s: float = 0.0
    step_sleep_s: float = 0.0
    raise_after_steps: int | None = None
    exit_after_steps: int | None = None
    hang_after_steps: int | None = None
    worker_raise_after_steps: int | None = None
    worker_hang_after_steps: int | None = None
    raise_in_sampling_for_seed: int | None = None
    exit_for_seed: int | None = None
    kv_snapshot_block_sleep_s: float = 0.0
    exit_in_kv_restore: bool = False
    journal_commit_sleep_s: float = 0.0
    batch_completion_window_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> FaultInjector:
        """The faults a `GRACELM_TEST_HOOKS` value asks for; `FaultsError` naming what is wrong."""
        if not text:
            return cls()
        try:
            asked = json.loads(text)
        except json.JSONDecodeError as e:
            raise FaultsError(f"{ENV} is not valid JSON: {e}") from None
        if not isinstance(asked, dict):
            raise FaultsError(f"{ENV} must be a JSON object of faults")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in asked.items():
            name = key.removeprefix("test_")
            if not key.startswith("test_") or name not in fields:
                known = ", ".join(f"test_{n}" for n in fields)
                raise FaultsError(f"{ENV}: unknown fault {key!r} (known: {known})")
            values[name] = _checked(key, value, fields[name].type)
        return cls(**values)

    @property
    def active(self) -> bool:
        return self != FaultInjector()

    # -- the engine core ----------------------------------------------------------------------------------

    def before_model_load(self) -> None:
        if self.slow_load_s:
            logger.warning("delaying the model load by %.1f s (test fault)", self.slow_load_s)
            time.sleep(self.slow_load_s)

    def after_core_step(self, steps: int) -> None:
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        _act_after(steps, "the engine core", raise_at=self.raise_after_steps, exit_at=self.exit_after_steps,
                   hang_at=self.hang_after_steps)

    def after_worker_step(self, rank: int, steps: int) -> None:
        _act_after(steps, f"worker rank {rank}", raise_at=self.worker_raise_after_steps, exit_at=None,
                   hang_at=self.worker_hang_after_steps)

    def in_sampling(self, seeds: Iterable[int | None]) -> None:
        """Called with the seeds of the rows a sampler is about to sample."""
        seeds = set(seeds)
        if self.exit_for_seed is not None and self.exit_for_seed in seeds:
            os._exit(EXIT_CODE)
        if self.raise_in_sampling_for_seed is not None and self.raise_in_sampling_for_seed in seeds:
            raise RuntimeError(f"sampling failure injected by the test fault for seed "
                               f"{self.raise_in_sampling_for_seed}")

    # -- state on disk --------------------------------------------------------------------------------------

    def kv_block_delay(self) -> Callable[[], None] | None:
        """What a KV-cache snapshot calls after each block it writes, if anything."""
        delay = self.kv_snapshot_block_sleep_s
        return (lambda: time.sleep(delay)) if delay else None

    def in_kv_restore(self) -> None:
        if self.exit_in_kv_restore:
            os._exit(EXIT_CODE)

    def before_journal_commit(self) -> None:
        if self.journal_commit_sleep_s:
            time.sleep(self.journal_commit_sleep_s)

    def completion_window_s(self, default: float) -> float:
        """A new batch's completion window, in seconds."""
        return default if self.batch_completion_window_s is None else self.batch_completion_window_s


def _checked(key: str, value: object, annotation: str) -> object:
    """`value` if it fits the field's annotation (a string, under `from __future__ import annotations`)."""
    kinds = {"float": (int, float), "int": (int,), "bool": (bool,)}
    expected = kinds[annotation.split(" |")[0]]
    if isinstance(value, bool) and bool not in expected or not isinstance(value, expected):
        raise FaultsError(f"{ENV}: {key} must be {annotation.split(' |')[0]}, not {value!r}")
    return value


def _act_after(steps: int, who: str, raise_at: int | None, exit_at: int | None, hang_at: int | None) -> None:
    if raise_at is not None and steps >= raise_at:
        raise RuntimeError(f"failure injected by the test fault in {who} after {steps} steps")
    if exit_at is not None and steps >= exit_at:
        logger.warning("%s exiting with code %d on purpose (test fault) after %d steps", who, EXIT_CODE,
                       steps)
        os._exit(EXIT_CODE)
    if hang_at is not None and steps >= hang_at:
        logger.warning("%s hanging on purpose (test fault) after %d steps", who, steps)
        while True:
            time.sleep(3600)


@functools.cache
def faults() -> FaultInjector:
    """This process's faults, read once; `FaultsError` if the variable is wrong."""
    injector = FaultInjector.parse(os.environ.get(ENV))
    if injector.active:
        logger.warning("test-only faults active: %s", os.environ[ENV])
    return injector
