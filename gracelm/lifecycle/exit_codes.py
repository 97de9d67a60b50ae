"""The exit codes of gracelm's processes: few, distinct and stable, so that whatever supervises the server
(systemd, Kubernetes, a shell script) can tell a stop from a crash, and a crash from a start that can never
succeed (restarting that one in a loop only hides the cause).

    0  CLEAN_STOP       stopped on request (SIGTERM, SIGINT, `Engine.shutdown()`), after the drain
    1  FATAL            a failure while serving: a child died, raised, reported a fatal error or hung
    2  USAGE            bad command line or option values; nothing was started
    3  STARTUP_FAILURE  the server could not start (port taken, model not loadable or not fitting in
                        memory, engine core failed)
  130  INTERRUPTED      `gracelm run-batch` stopped by Ctrl-C before its end (128 + SIGINT, as a shell
                        reports it); its finished lines are kept, and the same command resumes it

A start-up that is abandoned because a stop was requested exits with CLEAN_STOP: it did what it was told.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    CLEAN_STOP = 0
    FATAL = 1
    USAGE = 2
    STARTUP_FAILURE = 3
    INTERRUPTED = 130
