"""`lifecycle/startup_objects.py`: what start-up made leaves the cyclic collector's reach; what serving makes
afterwards does not."""

from __future__ import annotations

import gc

from gracelm.lifecycle.startup_objects import freeze_startup_objects


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
