"""Tenures: one order for sync's election, load's choice of checkpoint and retention."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import elastic
from elastic.checkpoint import saveload as C
from elastic.checkpoint.manifest import scan
from elastic.checkpoint.storage.local import LOCAL
from elastic.state.tenure import (
    Incomparable,
    as_saveable,
    check_saveable,
    elect,
    exceeds,
    greater,
    has_nan,
    is_saveable,
    order_key,
)

#: Tenures as ranks would report them, one family of mutually comparable values per case.
CASES: dict[str, list[Any]] = {
    "ints": [3, 7, 1, 7, 2],
    "floats": [0.5, 2.25, -1.0, float("inf"), 1e-3],
    "int and float": [2, 2.5, 3, 3.0, 1],
    "tuples": [(1, 2), (1, 10), (0, 99), (1, 10), (1,)],
    "strings": ["b", "ab", "c", "ba", "c"],
    "none": [None, 4, None, 2, 4],
}
EXPECTED_WINNER = {"ints": 1, "floats": 3, "int and float": 2, "tuples": 1, "strings": 2, "none": 1}


@elastic.elastic_state(tenure="step")
@attrs.define
class Counter:
    step: Any = None
    weight: torch.Tensor = attrs.field(factory=lambda: torch.zeros(3))


def _seen(tenures: list[Any]) -> list[C._LoadRecord]:
    """Load's records: rank r sees one checkpoint of tenure `tenures[r]`."""
    return [C._LoadRecord(tenure=None, seen=(C._Seen(t, 0, f"/ckpt/{r}", 1),)) for r, t in enumerate(tenures)]


def _descending(values: list[Any]) -> list[Any]:
    """`values` sorted by `greater` alone, most tenured first (stable: ties keep their order)."""

    def cmp(a: Any, b: Any) -> int:
        return -1 if greater(a, b) else (1 if greater(b, a) else 0)

    return sorted(values, key=functools.cmp_to_key(cmp))


@pytest.mark.parametrize("case", sorted(CASES))
def test_election_load_choice_and_retention_order_agree(case: str) -> None:
    tenures = CASES[case]
    winner = elect(tenures)
    assert winner == EXPECTED_WINNER[case]  # the maximum, ties to the lowest rank
    # load picks the same checkpoint among the ones the ranks see
    assert C._best_candidate(_seen(tenures), set()) == (winner, 0)
    # scan (and so retention) sorts by order_key: its first is the winner, ties kept in rank order
    by_key = sorted(range(len(tenures)), key=lambda r: order_key(tenures[r]), reverse=True)
    assert tenures[by_key[0]] == tenures[winner]
    assert [tenures[r] for r in by_key] == _descending(tenures)
    # and pairwise: order_key agrees with greater wherever greater compares
    for a in tenures:
        for b in tenures:
            assert greater(a, b) == (order_key(a) > order_key(b)), (a, b)


@pytest.mark.parametrize("case", sorted(set(CASES) - {"none"}))
def test_saved_checkpoints_are_scanned_retained_and_loaded_in_the_election_order(
    case: str, tmp_path: Path
) -> None:
    distinct = list({order_key(t): t for t in CASES[case]}.values())  # one checkpoint per tenure
    state = Counter()
    for value in distinct:
        state.step = value
        elastic.save(state, tmp_path / "all", keep=None)
    found = [c.tenure for c in scan(tmp_path / "all", storage=LOCAL)]
    assert [order_key(t) for t in found] == [order_key(t) for t in _descending(distinct)]
    assert found[0] == distinct[elect(distinct)]
    # retention keeps the two most tenured, and the checkpoint just written
    for value in distinct:
        state.step = value
        elastic.save(state, tmp_path / "kept", keep=2)
    kept = {order_key(c.tenure) for c in scan(tmp_path / "kept", storage=LOCAL)}
    assert kept == {order_key(t) for t in [*_descending(distinct)[:2], distinct[-1]]}
    # load (a fresh state: tenure None) reads the checkpoint the election would choose
    fresh = Counter()
    report = elastic.load(fresh, tmp_path / "all")
    assert report.source == "checkpoint" and order_key(report.tenure) == order_key(found[0])


def test_none_is_least_and_ties_go_to_the_lowest_rank() -> None:
    assert elect([None, None, None]) == 0
    assert elect([None, 0, None]) == 1
    assert elect([5, 5, 5]) == 0
    assert greater(0, None) and not greater(None, 0) and not greater(None, None)
    assert order_key(None) < order_key(-(10**9)) and order_key(None) < order_key("")


def test_nan_cannot_be_elected() -> None:
    assert has_nan(float("nan")) and has_nan((1, (2, float("nan")))) and not has_nan((1, 2.0))
    with pytest.raises(elastic.TenureError, match=r"sync: tenure is NaN on rank 1 \(nan\); NaN cannot be"):
        elect([1.0, float("nan"), 2.0])
    with pytest.raises(elastic.TenureError, match=r"save: tenure is NaN on ranks 0, 2"):
        elect([(1, float("nan")), 1, (float("nan"),)], "save")


def test_incomparable_tenures_name_both_ranks() -> None:
    with pytest.raises(elastic.TenureError) as info:
        elect([1, "a"], "most_tenured_rank")
    assert str(info.value) == (
        "most_tenured_rank: tenures cannot be compared: rank 0 has 1 (int) and rank 1 has 'a' (str); "
        "the tenure callable must return values of one orderable type on every rank"
    )
    with pytest.raises(elastic.TenureError, match=r"rank 0 has True \(bool\) and rank 1 has 2 \(int\)"):
        elect([True, 2])  # a bool is not a number here
    with pytest.raises(elastic.TenureError, match=r"rank 0 has \{'a': 1\} \(dict\) and rank 1 has"):
        elect([{"a": 1}, {"a": 2}])  # one type, but dicts have no order
    with pytest.raises(elastic.TenureError, match=r"rank 0 has \(1, 2\) .*rank 1 has \(1, 'x'\)"):
        elect([(1, 2), (1, "x")])  # tuples whose elements do not compare
    with pytest.raises(Incomparable):
        greater("a", 1)


def test_exceeds_names_what_it_compares() -> None:
    assert exceeds(3, 2.5, "checkpoint a", "rank 0's state", "load")
    assert not exceeds(None, 2, "checkpoint a", "rank 0's state", "load")
    with pytest.raises(elastic.TenureError) as info:
        exceeds("x", 2, "checkpoint /a", "rank 0's state", "load")
    assert str(info.value).startswith(
        "load: the tenure 'x' of checkpoint /a cannot be compared with the tenure 2 of rank 0's state; "
        "tenures must be of one orderable type (remove checkpoints of another run"
    )


def test_saveable_tenures() -> None:
    for ok in (None, 0, -3, 1.5, float("inf"), "s", True, (1, (2, "a")), ()):
        assert is_saveable(ok)
        check_saveable(ok)
    for bad in (float("nan"), (1, float("nan")), [1, 2], {"a": 1}, torch.tensor(1), object()):
        assert not is_saveable(bad)
    with pytest.raises(TypeError, match=r"save: the tenure \[1, 2\] \(list\) cannot be stored"):
        check_saveable([1, 2])
    with pytest.raises(TypeError, match=r"load: the tenure nan \(float\) cannot be stored"):
        check_saveable(float("nan"), "load")


def test_integer_like_tenures_save_as_integers(tmp_path: Path) -> None:
    import json

    import numpy as np

    assert as_saveable((np.int64(3), np.float32(0.5), 2, "x")) == (3, 0.5, 2, "x")
    assert type(as_saveable(np.int32(3))) is int

    @elastic.elastic_state(tenure=lambda s: np.int64(s.step))
    @attrs.define
    class NumpyStep:
        step: int = 0

    path = elastic.save(NumpyStep(7), tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["tenure"] == 7
    fresh = NumpyStep()
    report = elastic.load(fresh, tmp_path)
    assert report.source == "checkpoint" and report.tenure == 7 and fresh.step == 7
