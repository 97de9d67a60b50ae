"""`--device`: declared and checked like every option, resolved in the engine core (the frontend loads no
torch), and a device this machine cannot give refused at start with an error naming the option. The CUDA
paths themselves are run by `bench/cuda_check.sh` on a GPU machine: the suite stays skip-free on a CPU."""

from __future__ import annotations

import subprocess

import pytest
import torch

from gracelm import Engine, SamplingParams
from gracelm.config import EngineConfig
from gracelm.engine.errors import EngineStartupError
from gracelm.model.device import resolve_device
from tests.process_checks import assert_nothing_left
from tests.server_process import GRACELM
from tests.tiny_models import tiny_model


def test_auto_is_cuda_only_where_torch_sees_a_gpu_and_the_model_is_not_split():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto", tensor_parallel_size=2) == torch.device("cpu")


def test_a_device_that_cannot_serve_the_config_is_refused_naming_it():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match=r"device cuda \(--device\) is not supported with "
                                         r"tensor_parallel_size > 1"):
        EngineConfig(device="cuda", tensor_parallel_size=2)
    result = subprocess.run([str(GRACELM), "serve", "--device", "tpu"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "--device: invalid choice: 'tpu'" in result.stderr, result.stderr


def test_cuda_without_a_gpu_fails_the_start_naming_the_option(monkeypatch):
    # No GPU visible to the engine core, whatever this machine has: the refusal is tested everywhere.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(EngineStartupError, match=r"device 'cuda' \(--device cuda\) is not available here"):
        Engine(str(tiny_model("llama")), device="cuda", num_threads=1)
    assert_nothing_left()


def test_cpu_given_explicitly_serves():
    with Engine(str(tiny_model("llama")), device="cpu", num_threads=1, max_model_len=64) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_nothing_left()
