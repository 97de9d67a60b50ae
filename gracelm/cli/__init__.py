"""The `gracelm` command: `serve`, `generate`, `run-batch` and `deploy` (`main.py`)."""
