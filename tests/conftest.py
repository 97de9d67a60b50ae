"""Suite-wide settings. The suite runs the pytest process and engine-core processes side by side on few
cores: OpenMP threads that spin while waiting then steal the cores the other process needs (measured: a
default-model forward 10x slower under load), so test processes wait passively. Set before torch loads."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
