"""What uvicorn's access log leaves out: the requests to `--disable-access-log-for-endpoints` (vLLM's
option), such as a router's `/ready` check every second or a scraper's `/metrics`, which would otherwise be
most of the log. The path is compared without its query string; every other line is kept."""

from __future__ import annotations

import logging

# uvicorn's access-log record: (client address, method, path with query, HTTP version, status code).
_PATH_ARG = 2


class QuietEndpoints(logging.Filter):
    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) <= _PATH_ARG or not isinstance(args[_PATH_ARG], str):
            return True
        return args[_PATH_ARG].partition("?")[0] not in self.paths


def quiet_endpoints(paths: list[str]) -> None:
    if paths:
        logging.getLogger("uvicorn.access").addFilter(QuietEndpoints(paths))
