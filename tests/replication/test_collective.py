"""The collectives of one call: the single-process stand-in and the first error every rank raises."""

from __future__ import annotations

import attrs
import pytest

from elastic.replication.collective import Collective, error_field, raise_first


@attrs.frozen
class Row:
    value: int = 0
    error: str | None = None


def test_without_a_group_gather_returns_the_record_itself() -> None:
    solo = Collective.of(None, None, "test")
    assert solo.solo and (solo.rank, solo.world) == (0, 1) and solo.comm is None
    row = Row(3)
    gathered = solo.gather(row, "phase")
    assert gathered == [row] and gathered[0] is row


def test_raise_first_raises_for_the_lowest_failing_rank() -> None:
    rows = [Row(0), Row(1, "disk full"), Row(2, "bad tenure")]
    with pytest.raises(ValueError, match=r"^rank 1: disk full$") as info:
        raise_first(rows, lambda rank, error: ValueError(f"rank {rank}: {error}"))
    assert info.value.__suppress_context__
    raise_first([Row(0), Row(1)], lambda rank, error: ValueError("never"))  # no error: no raise
    with pytest.raises(KeyError, match="'b'"):
        raise_first(["a", None, "b"], lambda rank, e: KeyError(e), error_of=lambda e: e if e != "a" else None)


def test_gather_checked_gathers_then_raises() -> None:
    solo = Collective(None)
    assert solo.gather_checked(Row(5), "p", lambda r, e: RuntimeError(e)) == [Row(5)]
    with pytest.raises(RuntimeError, match=r"^rank 0 broke$"):
        solo.gather_checked(Row(error="broke"), "p", lambda r, e: RuntimeError(f"rank {r} {e}"))
    assert error_field(object()) is None and error_field(Row(error="x")) == "x"
