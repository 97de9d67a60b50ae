"""`lifecycle/startup_objects.py`: what start-up made leaves the cyclic collector's reach; what serving makes
afterwards does not."""

from __future__ import annotations

import gc

from gracelm.lifecycle.startup_objects import freeze_startup_objects, imports_uncollected, pause_collection


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


def test_imports_run_uncollected_and_their_objects_are_frozen_after() -> None:
    """The collector is paused inside and runs after; what was made inside is frozen, garbage included (a
    cycle made inside is never collected), and a cycle made after is collected."""
    before = gc.get_freeze_count()
    try:
        with imports_uncollected():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]
            cycle: list = []
            cycle.append(cycle)
            del cycle
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made) + 1
        assert gc.collect() == 0  # the frozen cycle is out of reach
        later: list = []
        later.append(later)
        del later
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()


def test_a_paused_collection_runs_again_once_start_up_objects_are_frozen() -> None:
    try:
        pause_collection()
        assert not gc.isenabled()
        freeze_startup_objects()
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
