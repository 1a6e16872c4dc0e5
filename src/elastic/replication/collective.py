"""The collectives of one call: gather a record from every rank, and agree on the first error.

Every collective operation of the library has the same shape: each rank builds a small record of what it
found (a tenure, the checkpoints it sees, whether its part worked), the records are all-gathered as
cloudpickle bytes, and if any rank's record carries an error, every rank raises the error of the lowest
such rank. The error is built from the gathered records alone, so every rank raises the same one.

Without a process group, or in a group of one, `Collective.solo` is true and `gather` returns the record
itself: the single-process stand-in every operation shares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import cloudpickle

from elastic.replication.comm import INLINE_BYTES, Comm

__all__ = ["Collective", "error_field", "raise_first"]

T = TypeVar("T")


def error_field(record: Any) -> Any:
    """A record's ``error`` attribute (`None` when it has none): the default error of a record."""
    return getattr(record, "error", None)


def raise_first(
    records: Sequence[T],
    fail: Callable[[int, Any], BaseException],
    error_of: Callable[[T], Any] = error_field,
) -> None:
    """Raise ``fail(rank, error)`` for the lowest rank whose record has an error (`error_of`), if any."""
    for rank, record in enumerate(records):
        error = error_of(record)
        if error is not None:
            raise fail(rank, error) from None


class Collective:
    """A group as one call sees it (`comm`, `rank`, `world`), or the single-process stand-in."""

    def __init__(self, comm: Comm | None) -> None:
        self.comm = comm
        self.rank = comm.rank if comm is not None else 0
        self.world = comm.world_size if comm is not None else 1

    @classmethod
    def of(cls, group: Any, deadline: timedelta | None, op: str) -> Collective:
        """The collectives of `op` on `group` (`None`: the default group), bounded by `deadline`."""
        return cls(Comm.of(group, deadline, op))

    @property
    def solo(self) -> bool:
        """Whether there is nobody else to talk to (no process group, or a world of one)."""
        return self.comm is None

    def gather(self, record: T, phase: str, inline: int = INLINE_BYTES) -> list[T]:
        """Every rank's `record` in rank order (cloudpickled: the records of trusted peers); one collective
        when every record pickles to less than `inline` bytes (the same on every rank), else two."""
        if self.comm is None:
            return [record]
        rows = self.comm.all_gather_bytes(cloudpickle.dumps(record), phase, inline)
        return [cloudpickle.loads(r) for r in rows]

    def errors(self, error: T | None, phase: str) -> list[T | None]:
        """Every rank's `error` (None: it succeeded) in rank order: one all-reduce when every rank
        succeeded, the gather of the errors after it otherwise."""
        if self.comm is None:
            return [error]
        if not self.comm.any_rank(error is not None, phase):
            return [None] * self.world
        return self.gather(error, phase)

    def gather_checked(
        self,
        record: T,
        phase: str,
        fail: Callable[[int, Any], BaseException],
        error_of: Callable[[T], Any] = error_field,
    ) -> list[T]:
        """`gather`, then `raise_first`: every rank returns the same records or raises the same error."""
        records = self.gather(record, phase)
        raise_first(records, fail, error_of)
        return records
