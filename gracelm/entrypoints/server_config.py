"""The HTTP server's own options (`gracelm serve`), declared once like the engine's (`gracelm.options`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from gracelm import options
from gracelm.lifecycle.last_shutdown import writable_dir_problem
from gracelm.options import at_least, in_range, option

API_KEY_ENV = "GRACELM_API_KEY"


@dataclass
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "port to bind (0: any free one)", check=in_range(0, 65535))
    api_key: str | None = option(None, f"require `Authorization: Bearer KEY` on /v1 routes (or set "
                                       f"{API_KEY_ENV})")
    served_model_name: str | None = option(None, "the model name clients use (default: the model's)")
    max_waiting_requests: int | None = option(None, "answer 503 when this many admitted requests wait to "
                                                    "start (default: no limit)", check=at_least(1))
    max_request_body_bytes: int = option(1 << 20, "answer 413 to larger request bodies", check=at_least(1))
    max_stop_strings: int = option(64, "answer 400 to a request with more stop strings", check=at_least(0))
    max_stop_chars: int = option(4096, "answer 400 to a request whose stop strings are longer than this in "
                                       "all", check=at_least(0))
    header_timeout: float = option(10.0, "seconds a client may take to send a request's headers; the "
                                         "connection is closed after that", check=at_least(0.001))
    stats_interval: float = option(10.0, "seconds between stats log lines (0: none)", check=at_least(0))
    drain_grace_period: float = option(0.0, "seconds to keep accepting new requests after readiness turns "
                                            "503 at a stop", check=at_least(0))
    state_dir: str | None = option(None, "directory kept across restarts; holds last-shutdown.json, the last "
                                         "stop's report, shown on /status (default: none kept)",
                                   check=writable_dir_problem)

    def __post_init__(self) -> None:
        options.validate(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """Raises `ValueError` on invalid values; the API key may come from the environment."""
        api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
        return options.from_args(cls, args, api_key=api_key)
