"""Errors raised by sfq. Argument errors use the builtin ValueError/TypeError/OverflowError."""

from __future__ import annotations

__all__ = ["SFQError"]


class SFQError(Exception):
    """Base class of every library error sfq raises."""
