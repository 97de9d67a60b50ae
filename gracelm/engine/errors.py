"""Errors the engine raises to its callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served any more."""


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message carries the cause reported by the core."""
