"""systemd's notification protocol (sd_notify(3)): newline-separated `KEY=VALUE` fields sent as one datagram
to the `AF_UNIX` socket named by `$NOTIFY_SOCKET` — a path, or with a leading `@` a name in the abstract
namespace. `$WATCHDOG_USEC` asks for a `WATCHDOG=1` at least that often, unless `$WATCHDOG_PID` names another
process.

A few lines over a socket: no library is needed (the maintained ones wrap libsystemd in C). A send never
blocks (`MSG_DONTWAIT`) and never raises: a notification that cannot be delivered (the socket gone, its
queue full) is logged once per run of failures, and the server serves on.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

logger = logging.getLogger(__name__)

NOTIFY_SOCKET = "NOTIFY_SOCKET"
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"


class SdNotify:
    """`SdNotify.from_env()`; `enabled` when systemd (or a test acting as it) listens; `watchdog_usec` when it
    expects pings from this process."""

    def __init__(self, address: str | bytes | None, watchdog_usec: int | None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec if address is not None else None
        self._failing = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> SdNotify:
        return cls(_address(environ.get(NOTIFY_SOCKET)), _watchdog_usec(environ))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: object) -> bool:
        """Sends `KEY=value` lines (keyword order kept); True if delivered. Values must be one line each."""
        if self.address is None:
            return False
        data = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(data, socket.MSG_DONTWAIT, self.address)
        except OSError as e:
            if not self._failing:
                logger.warning("systemd notification %s not delivered to %s: %s (the server serves on; "
                               "further failures are not logged until one succeeds)",
                               ",".join(fields), os.environ.get(NOTIFY_SOCKET), e)
            self._failing = True
            return False
        if self._failing:
            logger.info("systemd notifications delivered again")
            self._failing = False
        return True


def _address(value: str | None) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):  # the abstract namespace: a leading NUL byte, no file
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    logger.warning("%s=%r is neither a path nor an abstract socket name (@...): no systemd notifications",
                   NOTIFY_SOCKET, value)
    return None


def _watchdog_usec(environ: Mapping[str, str]) -> int | None:
    text = environ.get(WATCHDOG_USEC)
    if not text:
        return None
    pid = environ.get(WATCHDOG_PID)
    if pid and pid != str(os.getpid()):
        logger.info("%s=%s is another process: its watchdog is not this one's", WATCHDOG_PID, pid)
        return None
    try:
        usec = int(text)
    except ValueError:
        usec = 0
    if usec <= 0:
        logger.warning("%s=%r is not a positive number of microseconds: no watchdog pings", WATCHDOG_USEC,
                       text)
        return None
    return usec
