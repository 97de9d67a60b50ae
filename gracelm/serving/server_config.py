"""The HTTP server's own options (`gracelm serve`), declared once like the engine's (`gracelm.options`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from gracelm import options
from gracelm.lifecycle.last_shutdown import writable_dir_problem
from gracelm.options import at_least, in_range, option, positive_duration
from gracelm.serving import reasoning_parsers, tool_parsers
from gracelm.serving.chat_template_option import chat_template_problem
from gracelm.serving.generation_defaults import generation_config_problem

API_KEY_ENV = "GRACELM_API_KEY"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
METRICS_NAMES = ("gracelm", "vllm")


def _paths(values: list[str]) -> list[str]:
    """The paths of `--disable-access-log-for-endpoints`: each value a path or several separated by commas,
    as vLLM takes them."""
    return [path.strip() for value in values for path in value.split(",") if path.strip()]


def _paths_problem(values: list[str]) -> str | None:
    wrong = [path for path in _paths(values) if not path.startswith("/")]
    return f"takes paths such as /ready, got {wrong[0]!r}" if wrong else None


def _reasoning_parser_problem(value: str | None) -> str | None:
    names = reasoning_parsers.NAMES
    return None if value is None or value in names else f"must be one of {', '.join(names)}, got {value!r}"


@dataclass
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "port to bind (0: any free one)", check=in_range(0, 65535))
    api_key: list[str] = option([], f"require `Authorization: Bearer KEY` on /v1 routes, any of these "
                                    f"keys (or set {API_KEY_ENV} to one)")
    served_model_name: list[str] = option([], "the model names clients may use; the first is the one "
                                              "reported (default: the model's)")
    chat_template: str | None = option(None, "a chat template, as a file path or inline Jinja text, used "
                                             "instead of the model's", check=chat_template_problem)
    generation_config: str = option("auto", "sampling defaults for fields a request leaves out: auto (the "
                                            "model's generation_config.json), vllm (gracelm's own), or a "
                                            "folder holding a generation_config.json",
                                        check=generation_config_problem)
    max_logprobs: int = option(20, "answer 400 to a request asking for more logprobs or top_logprobs "
                                   "(20 is the engine's limit)", check=in_range(0, 20))
    disable_log_requests: bool = option(False, "do not log each request's id, prompt length and sampling "
                                               "parameters (logged at INFO by default)")
    uvicorn_log_level: str = option("info", "log level of the HTTP server (uvicorn)",
                                    choices=UVICORN_LOG_LEVELS)
    metrics_names: str = option("gracelm", "the names /metrics exports: gracelm (gracelm_*), or vllm "
                                           "(gracelm_* and also vLLM's vllm:* names and labels, for its "
                                           "dashboards)", choices=METRICS_NAMES)
    tool_call_parser: str = option("auto", "how tool calls are read from the model's output: auto (from the "
                                           "chat template), or a family's parser by vLLM's name",
                                   choices=tool_parsers.NAMES)
    reasoning_parser: str | None = option(None, "set a reasoning model's thinking apart from its answer "
                                                "(reasoning_content): qwen3, deepseek_r1, or auto (from the "
                                                "chat template); default: none, the thinking is content",
                                          check=_reasoning_parser_problem)
    max_num_queued_reqs: int | None = option(None, "answer 429 to a request that would put more than this "
                                                   "many sequences in flight, running or waiting (0: no "
                                                   "limit; default: twice the full-context requests the KV "
                                                   "cache holds, at least --max-num-seqs)", check=at_least(0))
    max_queue_wait: float | None = option(None, "seconds a request may wait for its first token; then it is "
                                                "aborted and answered 429 (default: no limit)",
                                          check=at_least(0.001))
    max_request_body_bytes: int = option(1 << 20, "answer 413 to larger request bodies", check=at_least(1))
    max_upload_bytes: int = option(200 << 20, "answer 413 to a larger file upload (POST /v1/files, a batch's "
                                              "input)", check=at_least(1))
    max_stop_strings: int = option(64, "answer 400 to a request with more stop strings", check=at_least(0))
    max_stop_chars: int = option(4096, "answer 400 to a request whose stop strings are longer than this in "
                                       "all", check=at_least(0))
    allowed_hosts: list[str] = option([], "the Host names the server answers to, against DNS rebinding "
                                          "(* any; default: localhost, 127.0.0.1 and [::1] when bound to a "
                                          "loopback address, else any)")
    allowed_origins: list[str] = option([], "web origins (https://app.example) whose pages may call the "
                                            "API from a browser, with CORS answers (default: none; vLLM's "
                                            "is any)")
    trust_request_chat_template: bool = option(False, "accept a request's own chat_template (vLLM's flag), "
                                                      "rendered within a budget of time and size; refused "
                                                      "by default")
    header_timeout: float = option(10.0, "seconds a client may take to send a request's headers; the "
                                         "connection is closed after that", check=at_least(0.001))
    body_timeout: float = option(60.0, "seconds a request's body may pause (no byte of it comes); the "
                                       "connection is closed after that", check=at_least(0.001))
    disable_access_log_for_endpoints: list[str] = option(
        [], "paths (comma-separated, or the option repeated) whose requests the access log leaves out, as "
            "vLLM's option does: /ready,/health,/metrics for probes, routers' checks and scrapers",
        check=_paths_problem)
    stats_interval: float = option(10.0, "seconds between stats log lines (0: none)", check=at_least(0))
    drain_grace_period: float = option(0.0, "seconds to keep accepting new requests after readiness turns "
                                            "503 at a stop", check=at_least(0))
    state_dir: str | None = option(None, "directory kept across restarts; holds last-shutdown.json, the last "
                                         "stop's report, shown on /status, and batches.db, the journal of "
                                         "the files and batches of /v1/files and /v1/batches and of the "
                                         "responses /v1/responses stores, which need it (default: none kept)",
                                   check=writable_dir_problem)
    max_stored_responses: int = option(10000, "the most responses of the Responses API kept in --state-dir "
                                              "(store); the oldest are dropped beyond it", check=at_least(1))
    stored_response_max_age: str = option("30d", "how long a stored response of the Responses API is kept: "
                                                 "seconds, or a number with s, m, h or d",
                                          check=positive_duration)

    @property
    def quiet_paths(self) -> list[str]:
        """The paths whose requests the access log leaves out."""
        return _paths(self.disable_access_log_for_endpoints)

    def __post_init__(self) -> None:
        options.validate(self)
        for name in ("api_key", "served_model_name"):
            if any(not value for value in getattr(self, name)):
                raise ValueError(f"{name} must not be empty")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """Raises `ValueError` on invalid values; the API key may come from the environment, where a variable
        set but empty is refused as `--api-key ""` is (it would turn authentication off unnoticed)."""
        api_key = getattr(args, "api_key", None)
        if not api_key:
            env_key = os.environ.get(API_KEY_ENV)
            if env_key == "":
                raise ValueError(f"{API_KEY_ENV} is set but empty: give it a key, or unset it (no key)")
            api_key = [env_key] if env_key is not None else []
        return options.from_args(cls, args, api_key=api_key)
