"""The collectives of one call: the single-process stand-in, the first error every rank raises, and on
three gloo ranks the errors of a commit and records too large for one round."""

from __future__ import annotations

from typing import Any

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


def test_without_a_group_errors_returns_the_error_itself() -> None:
    solo = Collective(None)
    assert solo.errors(None, "commit") == [None] and solo.errors("broke", "commit") == ["broke"]


def _on_ranks(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    group = Collective.of(None, None, "test")
    counts = {"all_reduce": 0, "all_gather": 0}
    real = {name: getattr(dist, name) for name in counts}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real[name](*args, **kwargs)

        return call

    out: dict[str, Any] = {}
    for name in counts:
        setattr(dist, name, counting(name))
    try:
        for key, call in [
            ("all succeed", lambda: group.errors(None, "commit")),
            ("rank 1 fails", lambda: group.errors("disk full" if rank == 1 else None, "commit")),
            ("large rows", lambda: group.gather("x" * 6000 + str(rank), "rows")),
            ("large rows inline", lambda: group.gather("x" * 6000 + str(rank), "rows", inline=16384)),
        ]:
            before = dict(counts)
            out[key] = (call(), {k: counts[k] - before[k] for k in counts})
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return out


@pytest.mark.timeout(120)
def test_errors_take_one_all_reduce_when_every_rank_succeeds() -> None:
    from dist_harness import run_on_ranks

    rows = ["x" * 6000 + str(r) for r in range(3)]
    for r in run_on_ranks(_on_ranks, 3):
        assert r["all succeed"] == ([None, None, None], {"all_reduce": 1, "all_gather": 0})
        assert r["rank 1 fails"] == ([None, "disk full", None], {"all_reduce": 1, "all_gather": 1})
        assert r["large rows"] == (
            rows,
            {"all_reduce": 0, "all_gather": 2},
        )  # the inline round, then the rest
        assert r["large rows inline"] == (rows, {"all_reduce": 0, "all_gather": 1})
