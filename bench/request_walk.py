"""Which of gracelm's modules and functions one chat request crosses in the API server process: the app of
`gracelm serve` built in this process (the engine core a child, as in `gracelm serve`), one request sent to
warm it up, then the same request again with every Python call recorded (`sys.setprofile`) from its
arrival to its last byte. Prints the modules and the count of functions; `--list` names the functions.
The architecture doc's walk (docs/architecture.md, "One request's path") is the same request in words.

    .venv/bin/python bench/request_walk.py            # a plain chat completion
    .venv/bin/python bench/request_walk.py --stream   # streamed (SSE)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import threading
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gracelm.config import EngineConfig  # noqa: E402
from gracelm.engine.async_engine import AsyncEngine  # noqa: E402
from gracelm.engine.messages import CoreState  # noqa: E402
from gracelm.lifecycle.ledger import Ledger  # noqa: E402
from gracelm.lifecycle.server_state import Lifecycle, ServerState  # noqa: E402
from gracelm.model.model_files import resolve_model_path  # noqa: E402
from gracelm.observability.metrics import ServerMetrics  # noqa: E402
from gracelm.server.app import build_app  # noqa: E402
from gracelm.serving.admission_control import max_in_flight  # noqa: E402
from gracelm.serving.server_config import ServerConfig  # noqa: E402
from gracelm.serving.serving_options import serving_options  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402


class CallRecorder:
    """Every gracelm function called, by module, while `recording` (all threads)."""

    def __init__(self) -> None:
        self.calls: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.recording = False

    def __call__(self, frame, event: str, _arg) -> None:
        if self.recording and event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("gracelm"):
                self.calls[module][frame.f_code.co_qualname] += 1

    def __enter__(self) -> CallRecorder:
        sys.setprofile(self)
        threading.setprofile(self)
        self.recording = True
        return self

    def __exit__(self, *_) -> None:
        self.recording = False
        sys.setprofile(None)
        threading.setprofile(None)


async def walk(model: str, stream: bool) -> CallRecorder:
    config = EngineConfig(model=model, kv_cache_memory="4MiB", num_threads=1)
    settings = ServerConfig()
    ledger = Ledger()
    engine = AsyncEngine.from_config(config, ledger=ledger)
    state = ServerState(max_in_flight(settings.max_num_queued_reqs, engine), settings.max_queue_wait)
    served = serving_options(settings, engine.model_name, resolve_model_path(model), engine.tokenizer)
    recorder = CallRecorder()
    with tempfile.TemporaryDirectory() as directory:
        metrics = ServerMetrics(Path(directory) / "prometheus", served.model_name,
                                tuple(s.value for s in Lifecycle), tuple(s.value for s in CoreState),
                                max_model_len=config.max_model_len)
        try:
            app = build_app(engine, settings, state, metrics, ledger, served)
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
            async with app.router.lifespan_context(app), httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000") as client:
                headers = {"Content-Type": "application/json"}
                (await client.post("/v1/chat/completions", json=body, headers=headers)).raise_for_status()
                with recorder:
                    reply = await client.post("/v1/chat/completions", json=body, headers=headers)
                reply.raise_for_status()
        finally:
            metrics.close()
            engine.shutdown(timeout=10)
            ledger.release_all()
    return recorder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model to serve (default: a tiny random-weight model)")
    parser.add_argument("--stream", action="store_true", help="a streamed request")
    parser.add_argument("--list", action="store_true", help="name every function called")
    args = parser.parse_args()
    recorder = asyncio.run(walk(args.model or str(tiny_model("llama")), args.stream))
    functions = sum(len(names) for names in recorder.calls.values())
    print(f"{'streamed' if args.stream else 'plain'} chat request: {len(recorder.calls)} modules, "
          f"{functions} functions")
    for module in sorted(recorder.calls):
        names = recorder.calls[module]
        print(f"  {module}: {len(names)}" + (f"  ({', '.join(sorted(names))})" if args.list else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
