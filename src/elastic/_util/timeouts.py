"""Timeouts as the library takes them: `None`, a `timedelta` or a positive number of seconds."""

from __future__ import annotations

from datetime import timedelta

__all__ = ["as_timedelta"]


def as_timedelta(timeout: timedelta | float | None, what: str) -> timedelta | None:
    """`None`, seconds or a `timedelta`, as a `timedelta`; anything else is a `TypeError`."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=float(timeout))
    msg = f"{what}(timeout=...) must be a timedelta or a positive number of seconds, got {timeout!r}"
    raise TypeError(msg) from None
