"""The device the model, attention and sampler tests run on: `GRACELM_TEST_DEVICE` (default cpu).
`bench/cuda_check.sh` sets it to cuda on a GPU machine; the suite never skips for want of one."""

import os

import torch

TEST_DEVICE = torch.device(os.environ.get("GRACELM_TEST_DEVICE", "cpu"))
