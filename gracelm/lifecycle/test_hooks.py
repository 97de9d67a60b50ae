"""TEST-ONLY fault injection, read from the environment by the process it acts in: never set in production.

`GRACELM_TEST_HOOKS` holds a JSON object; the engine core reads `test_slow_load_s` (sleep before the model
loads), `test_step_sleep_s` (slow every step), `test_raise_after_steps`, `test_hang_after_steps` and
`test_exit_after_steps` (raise, hang or `os._exit(5)` once that many steps have run), and
`test_kv_snapshot_block_sleep_s` (a KV-cache snapshot writes each block that much slower, so that a test
can kill the core half-way through a save). A tensor-parallel worker reads `test_worker_raise_after_steps` and
`test_worker_hang_after_steps` (raise or hang once it has run that many steps). The engine core's sampling
reads `test_raise_in_sampling_for_seed`: it raises for the rows of requests with that seed, so that a test
can show that only that request fails, and `test_exit_for_seed`: the core exits at once at a step with such a
request (work that kills the server); `test_exit_in_kv_restore` makes the core exit while it restores its
KV snapshot. Children inherit the
variable, so a test sets it around the start of a server or an engine and the hooks reach the core without
passing through any configuration.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

ENV = "GRACELM_TEST_HOOKS"

logger = logging.getLogger(__name__)


@functools.cache
def active_test_hooks() -> dict[str, Any]:
    """The hooks of this process (read once); an invalid value is an error naming the variable."""
    text = os.environ.get(ENV)
    if not text:
        return {}
    try:
        hooks = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV} is not valid JSON: {e}") from None
    if not isinstance(hooks, dict):
        raise ValueError(f"{ENV} must be a JSON object")
    logger.warning("test-only hooks active: %s", hooks)
    return hooks
