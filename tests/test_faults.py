"""The test-only faults (`lifecycle/faults.py`): one typed object, nothing by default, and a wrong name or
value refuses the start, naming it, so that a misspelled fault cannot pass as a test that proves nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest

from gracelm.engine.engine import Engine
from gracelm.lifecycle import faults as faults_module
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.faults import ENV, FaultInjector, FaultsError, faults
from tests.process_checks import assert_nothing_left
from tests.server_process import GRACELM
from tests.tiny_models import tiny_model


def test_without_the_variable_every_fault_does_nothing():
    injector = FaultInjector.parse(None)
    assert injector == FaultInjector() and not injector.active
    injector.before_model_load()
    injector.after_core_step(10**6)
    injector.after_worker_step(1, 10**6)
    injector.in_sampling([0, 1, None])
    injector.in_kv_restore()
    injector.before_journal_commit()
    assert injector.kv_block_delay() is None
    assert injector.completion_window_s(86400.0) == 86400.0


def test_a_fault_is_read_typed_and_acts():
    injector = FaultInjector.parse(json.dumps({"test_raise_in_sampling_for_seed": 7,
                                               "test_batch_completion_window_s": 2}))
    assert injector.active and injector.completion_window_s(86400.0) == 2
    injector.in_sampling([1, None])
    with pytest.raises(RuntimeError, match="seed 7"):
        injector.in_sampling([1, 7])
    with pytest.raises(RuntimeError, match="after 3 steps"):
        FaultInjector.parse('{"test_raise_after_steps": 3}').after_core_step(3)


@pytest.mark.parametrize(("value", "message"), [
    ('{"test_step_slep_s": 1}', "unknown fault 'test_step_slep_s'"),
    ('{"step_sleep_s": 1}', "unknown fault 'step_sleep_s'"),
    ('{"test_raise_after_steps": "5"}', "test_raise_after_steps must be int"),
    ('{"test_exit_in_kv_restore": 1}', "test_exit_in_kv_restore must be bool"),
    ('{"test_raise_after_steps": true}', "test_raise_after_steps must be int"),
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
])
def test_a_wrong_fault_is_refused_naming_it(value, message):
    with pytest.raises(FaultsError, match=message):
        FaultInjector.parse(value)


def test_the_docstring_is_the_one_list():
    listed = {word.strip("`:,") for word in faults_module.__doc__.split() if word.startswith("`test_")}
    assert listed == {f"test_{field.name}" for field in dataclasses.fields(FaultInjector)}


def test_serve_with_a_misspelled_fault_exits_2_before_loading_anything():
    env = {**os.environ, ENV: '{"test_hang_after_step": 5}'}
    refused = subprocess.run([str(GRACELM), "serve", tiny_model("llama"), "--port", "0"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == ExitCode.USAGE
    assert "unknown fault 'test_hang_after_step'" in refused.stderr
    assert "loaded" not in refused.stderr


def test_an_engine_with_a_misspelled_fault_fails_to_start_naming_it(monkeypatch):
    monkeypatch.setenv(ENV, '{"test_slow_lod_s": 1}')
    faults.cache_clear()
    try:
        with pytest.raises(FaultsError, match="test_slow_lod_s"):
            Engine(tiny_model("llama"), kv_cache_memory="1MiB", num_threads=1)
    finally:
        faults.cache_clear()
    assert_nothing_left()
