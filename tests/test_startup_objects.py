"""`lifecycle/startup_objects.py`: what start-up made leaves the cyclic collector's reach; what serving makes
afterwards does not."""

from __future__ import annotations

import gc

import pytest

from gracelm.lifecycle.startup_objects import freeze_startup_objects, imports_uncollected


def test_startup_objects_are_frozen_and_later_garbage_is_still_collected() -> None:
    started = [[] for _ in range(1000)]  # tracked containers, as start-up leaves
    before = gc.get_freeze_count()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() >= before + len(started)
        cycle: list = []
        cycle.append(cycle)  # garbage made while serving, reachable only from itself
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()  # the test process goes on as before


@pytest.mark.parametrize("enabled", [True, False])
def test_imports_run_uncollected_and_their_objects_are_frozen_after(enabled: bool) -> None:
    """The collector is paused inside, and put back as it was; what was made inside is frozen, garbage
    included (a cycle made inside is never collected), and a cycle made after is."""
    (gc.enable if enabled else gc.disable)()
    before = gc.get_freeze_count()
    try:
        with imports_uncollected():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]
            cycle: list = []
            cycle.append(cycle)
            del cycle
        assert gc.isenabled() == enabled
        assert gc.get_freeze_count() >= before + len(made) + 1
        assert gc.collect() == 0  # the frozen cycle is out of reach
        later: list = []
        later.append(later)
        del later
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
        gc.enable()
