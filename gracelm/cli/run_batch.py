"""`gracelm run-batch -i IN.jsonl -o OUT.jsonl [--state-dir DIR] [engine options]`: an OpenAI batch input file
run offline, in this process, with no HTTP (vLLM's command and flags), on the same journal and runner as the
server's `/v1/batches`, so it is resumable the same way.

The journal lives in `--state-dir` (default: `OUT.jsonl.state/`, beside the output; the arguments are parsed
by `cli/main.py`). The input is stored there once (found again by its checksum) with one batch; each
line's result is committed as it finishes. Ctrl-C stops at once: the running lines are aborted and stay
queued, the finished ones are kept, and the exit code is 130; the same command then resumes, running only
what is left. At the end OUT is written (atomically) in input order, one line per input line, in vLLM's
run-batch format: an answered line as OpenAI's output line, a refused one with `response.body` null and the
error body in `error`.

The input is checked before the engine starts (`batch/validation.py`); a bad file prints its errors and
exits 2. Unlike a server batch, the lines may mix `/v1/chat/completions` and `/v1/completions`, and the
batch never expires. The serving options are `gracelm serve`'s defaults (the model's name, its chat template
and generation config).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from gracelm import options
from gracelm.batch.journal import Journal, JournalError
from gracelm.batch.objects import COMPLETION_WINDOW, INPUT_PURPOSE, BatchRecord, Status
from gracelm.batch.runner import BatchRunner
from gracelm.batch.validation import validate_input
from gracelm.cache_dir import write_atomic
from gracelm.config import EngineConfig
from gracelm.engine.async_engine import AsyncEngine
from gracelm.engine.messages import CoreState
from gracelm.lifecycle.exit_codes import ExitCode
from gracelm.lifecycle.ledger import ResourceKind
from gracelm.lifecycle.server_state import Lifecycle, ServerState
from gracelm.model.model_files import resolve_model_path
from gracelm.observability.metrics import ServerMetrics
from gracelm.server.batch_lines import BatchLines
from gracelm.serving.grammar_checker import GrammarChecker
from gracelm.serving.request_fields import RequestLimits
from gracelm.serving.server_config import ServerConfig
from gracelm.serving.serving_chat import ServingChat
from gracelm.serving.serving_completion import ServingCompletion
from gracelm.serving.serving_options import serving_options

logger = logging.getLogger("gracelm.run_batch")

STATE_SUFFIX = ".state"
_POLL_S = 0.25  # how often the batch's status is read while it runs


def run_batch(args: argparse.Namespace) -> int:
    try:
        config = options.from_args(EngineConfig, args)
        content = Path(args.input_file).read_bytes()
    except (ValueError, OSError) as exc:
        return _fail(str(exc), ExitCode.USAGE)
    lines, errors = validate_input(content, None)
    if errors:
        for error in errors:
            print(f"gracelm run-batch: {args.input_file}:{error['line'] or '-'}: {error['code']}: "
                  f"{error['message']}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        journal = Journal(args.state_dir or args.output_file + STATE_SUFFIX)
    except (JournalError, OSError) as exc:
        return _fail(str(exc), ExitCode.USAGE)
    try:
        batch = _resume_or_create(journal, content)
        if batch.status is not Status.COMPLETED:
            code = _run_engine(config, journal, batch.id)
            if code != ExitCode.CLEAN_STOP:
                return code
        _write_output(journal, batch.id, Path(args.output_file))
    finally:
        journal.close()
    print(f"gracelm run-batch: {len(lines)} lines; output written to {args.output_file}", file=sys.stderr)
    return ExitCode.CLEAN_STOP


def _resume_or_create(journal: Journal, content: bytes) -> BatchRecord:
    """The batch of this input, if an earlier run made one (the input found by its checksum), else a new one
    that never expires, its lines on any endpoint."""
    file = journal.find_file(hashlib.sha256(content).hexdigest(), INPUT_PURPOSE)
    batch = None if file is None else journal.find_batch_of_file(file.id)
    if batch is not None:
        logger.info("resuming batch %s: %d of %d lines done", batch.id,
                    batch.counts.completed + batch.counts.failed, batch.counts.total)
        return batch
    if file is None:
        file = journal.add_file("input.jsonl", INPUT_PURPOSE, io.BytesIO(content))
    return journal.create_batch(file.id, None, COMPLETION_WINDOW, None, None)


def _run_engine(config: EngineConfig, journal: Journal, batch_id: str) -> int:
    try:
        engine = AsyncEngine.from_config(config)
    except Exception as exc:
        return _fail(f"the engine failed to start: {exc}", ExitCode.STARTUP_FAILURE)
    try:
        return asyncio.run(_run(engine, journal, batch_id))
    finally:
        engine.shutdown(timeout=0)


async def _run(engine: AsyncEngine, journal: Journal, batch_id: str) -> int:
    """Runs the batch to its end, or until Ctrl-C or the engine's end; the exit code."""
    state = ServerState()
    state.set(Lifecycle.RUNNING)
    settings = ServerConfig()
    served = serving_options(settings, engine.model_name, resolve_model_path(engine.config.model),
                             engine.tokenizer)
    metrics = ServerMetrics(engine.runtime_dir / "prometheus", served.model_name,
                            tuple(s.value for s in Lifecycle), tuple(s.value for s in CoreState))
    engine.ledger.acquire(ResourceKind.DIRECTORY, f"prometheus dir {metrics.directory}", metrics.close)
    limits = RequestLimits(settings.max_stop_strings, settings.max_stop_chars)
    grammars = GrammarChecker.for_engine(engine, engine.ledger)
    lines = BatchLines(ServingChat(engine, state, metrics, served, limits, grammars),
                       ServingCompletion(engine, state, metrics, served, limits, grammars))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    with _progress_bar(journal.get_batch(batch_id)) as bar:
        runner = BatchRunner(journal, lines, state, engine.config.max_num_seqs, on_committed=bar.update)
        task = asyncio.create_task(runner.run(), name="batch-runner")
        try:
            batch = await _until_end(engine, journal, batch_id, stop, bar)
            if batch is None and engine.failed:  # the running lines stay in flight: a crash of theirs
                state.set(Lifecycle.DEAD)
            elif batch is None:  # stopped: no new line; the running ones aborted, kept queued
                state.set(Lifecycle.DRAINING)
                engine.begin_shutdown(0)
                await state.wait_idle()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            loop.remove_signal_handler(signal.SIGINT)
    if batch is not None:
        print(f"gracelm run-batch: {runner.lines_answered} lines run now", file=sys.stderr)
        return ExitCode.CLEAN_STOP
    done = journal.get_batch(batch_id)
    assert done is not None
    print(f"gracelm run-batch: stopped with {done.counts.completed + done.counts.failed} of "
          f"{done.counts.total} lines done ({runner.lines_answered} run now); the same command resumes it",
          file=sys.stderr)
    return ExitCode.FATAL if engine.failed else ExitCode.INTERRUPTED


async def _until_end(engine: AsyncEngine, journal: Journal, batch_id: str, stop: asyncio.Event,
                     bar: Any) -> BatchRecord | None:
    """The batch once it has ended, or None if `stop` (Ctrl-C) or the engine's failure came first."""
    while not stop.is_set() and not engine.failed:
        batch = await asyncio.to_thread(journal.get_batch, batch_id)
        assert batch is not None
        if bar.total is None and batch.counts.total:
            bar.total = batch.counts.total
            bar.refresh()
        if batch.status is Status.COMPLETED:
            return batch
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _POLL_S)
    return None


@contextlib.contextmanager
def _progress_bar(batch: BatchRecord | None):
    from tqdm import tqdm

    counts = batch.counts if batch is not None else None
    with tqdm(total=counts.total if counts and counts.total else None, unit="line", desc="Running batch",
              initial=counts.completed + counts.failed if counts else 0, file=sys.stderr) as bar:
        yield bar


def _write_output(journal: Journal, batch_id: str, path: Path) -> None:
    """OUT in input order, atomically, in vLLM's run-batch format."""
    text = "".join(json.dumps(_vllm_line(output)) + "\n" for output in journal.results(batch_id))
    write_atomic(path, text.encode())


def _vllm_line(output: dict[str, Any]) -> dict[str, Any]:
    """vLLM writes a refused line's error body in `error` and no body in its response."""
    response = output["response"]
    if response is None or response["status_code"] == 200:
        return output
    return {**output, "response": {**response, "body": None}, "error": response["body"]}


def _fail(message: str, code: ExitCode) -> int:
    print(f"gracelm run-batch: {message}", file=sys.stderr)
    return code

