"""Pairs that cannot connect: the largest-set rule (`elastic.recovery.partition`) and its hooks in the
rendezvous (the ``xa|b,`` event, `decide`, `Rendezvous.unreachable`)."""

from __future__ import annotations

import itertools
import random
from datetime import timedelta
from typing import Any

import pytest

import elastic.recovery.partition as partition
from elastic.recovery.partition import largest_reachable
from elastic.recovery.rendezvous import Log, Rendezvous, decide, parse_log, read_round


def pair(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


# ------------------------------------------------------------------------------------------ the rule


def test_no_pair_keeps_everyone_in_the_given_order() -> None:
    assert largest_reachable(["c", "a", "b", "a"], []) == ("c", "a", "b")
    # pairs outside the participants, or of one participant, are no evidence
    assert largest_reachable(["a", "b"], [pair("a", "z"), frozenset({"a"})]) == ("a", "b")


def test_one_bad_pair_drops_one_end_preferring_previous_members_then_the_given_order() -> None:
    people = ["0", "1", "2", "3"]
    # ties: the later of the pair goes
    assert largest_reachable(people, [pair("2", "3")]) == ("0", "1", "2")
    assert largest_reachable(people, [pair("3", "2")], prefer=people) == ("0", "1", "2")
    # a previous member is kept before a newcomer, whatever the given order
    assert largest_reachable(people, [pair("2", "3")], prefer=["0", "1", "3"]) == ("0", "1", "3")
    # among previous members their order decides, not the given one (proposers see different join orders)
    assert largest_reachable(["3", "2", "0"], [pair("2", "3")], prefer=["0", "2", "3"]) == ("2", "0")
    assert largest_reachable(["2", "3", "0"], [pair("2", "3")], prefer=["0", "2", "3"]) == ("2", "0")


def test_the_largest_set_wins_over_the_preferred_order() -> None:
    # a star: the centre conflicts with three others; dropping it keeps four, whatever is preferred
    people = ["hub", "a", "b", "c", "d"]
    bad = [pair("hub", x) for x in "abc"]
    assert largest_reachable(people, bad, prefer=["hub"]) == ("a", "b", "c", "d")
    # two hosts cut off from two others (a full split, all reach the store): the first two go on
    split = [pair(x, y) for x in "01" for y in "23"]
    assert largest_reachable(["0", "1", "2", "3"], split) == ("0", "1")
    assert largest_reachable(["0", "1", "2", "3"], split, prefer=["2", "3"]) == ("2", "3")
    # a path 0-1-2-3: the largest sets are {0,2}, {0,3}, {1,3}; the earliest positions win
    path = [pair("0", "1"), pair("1", "2"), pair("2", "3")]
    assert largest_reachable(["0", "1", "2", "3"], path) == ("0", "2")


def _brute(people: list[str], bad: list[frozenset[str]]) -> int:
    for k in range(len(people), 0, -1):
        for chosen in itertools.combinations(people, k):
            if not any(p <= set(chosen) for p in bad):
                return k
    return 0


def test_exact_search_finds_a_largest_set_and_is_deterministic_on_random_graphs() -> None:
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(2, 9)
        people = [f"p{i}" for i in range(n)]
        bad = [pair(a, b) for a, b in itertools.combinations(people, 2) if rng.random() < 0.35]
        chosen = largest_reachable(people, bad, prefer=people[: n // 2])
        assert not any(p <= set(chosen) for p in bad)
        assert len(chosen) == _brute(people, bad), (people, bad, chosen)
        # the same answer whatever the order of the evidence
        assert largest_reachable(people, list(reversed(bad)), prefer=people[: n // 2]) == chosen


def test_past_the_exact_limit_a_greedy_still_leaves_no_bad_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(partition, "EXACT_LIMIT", 3)
    partition._solve.cache_clear()
    people = [f"p{i}" for i in range(8)]
    # p0 conflicts with everyone else: the greedy drops it (most conflicts) and keeps the rest
    bad = [pair("p0", p) for p in people[1:]] + [pair("p6", "p7")]
    chosen = largest_reachable(people, bad)
    assert chosen == ("p1", "p2", "p3", "p4", "p5", "p6")  # p7: the later of p6-p7
    partition._solve.cache_clear()


# ------------------------------------------------------------------------------- the rendezvous hooks


def test_parse_log_reads_unreachable_pairs_unordered() -> None:
    got = parse_log(b"+a,+b,xa|b,xb|a,xc|c,xa|c,=a|b,")
    assert got.unreachable == frozenset({pair("a", "b"), pair("a", "c")})
    assert got.joined == ("a", "b") and got.decision == ("a", "b")
    assert parse_log(b"+a,").unreachable == frozenset()


def _decide(prev: tuple[str, ...], log: Log, dead: set[str] | None = None, **kw: Any) -> Any:
    dead = dead or set()
    args = {"min_workers": 1, "max_workers": 1 << 30, "quiet": False, **kw}
    return decide(prev, log, alive=lambda p: p not in dead, ready=lambda p: p not in dead, **args)


def test_decide_keeps_the_largest_set_and_does_not_wait_for_the_side_left_out() -> None:
    prev = ("0", "1", "2", "3")
    cut = frozenset({pair("2", "3")})
    # everyone joined: the later of the pair is not a member (a straggler, it joins the next round)
    assert _decide(prev, Log(joined=("3", "0", "1", "2"), unreachable=cut)) == ("0", "1", "2")
    # 3 waits outside (alive, a previous member, not joined): not waited for
    assert _decide(prev, Log(joined=("0", "1", "2"), unreachable=cut)) == ("0", "1", "2")
    # without the evidence the round waits for it, as before
    assert _decide(prev, Log(joined=("0", "1", "2"))) is None
    # 2 has not joined yet: the round waits for the member that stays, and not for 3
    assert _decide(prev, Log(joined=("0", "1", "3"), unreachable=cut)) is None
    # 2 is dead: the pair is moot, 3 is a member
    assert _decide(prev, Log(joined=("0", "1", "3"), unreachable=cut), dead={"2"}) == ("0", "1", "3")
    # the largest set below min_workers: wait
    assert (
        _decide(("a", "b"), Log(joined=("a", "b"), unreachable=frozenset({pair("a", "b")})), min_workers=2)
        is None
    )


def test_decide_prefers_previous_members_over_a_newcomer_that_cannot_connect() -> None:
    prev = ("0", "1", "2")
    # a newcomer n cannot reach 1: n waits, the previous members go on (no regroup for nothing)
    log = Log(joined=("n", "0", "1", "2"), unreachable=frozenset({pair("n", "1")}))
    assert _decide(prev, log) == ("0", "1", "2")


def test_unreachable_reports_to_the_next_round() -> None:
    from elastic.recovery.store import connect, serve

    server = serve("127.0.0.1", 0, timeout=timedelta(seconds=10))
    rdzv = Rendezvous(
        connect("127.0.0.1", server.port, timeout=timedelta(seconds=10)),
        "partition",
        "a",
        join_timeout=timedelta(seconds=10),
        timeout=timedelta(seconds=2),
    )
    try:
        rdzv.unreachable([("a", "b")])  # before any generation: nowhere to report, nothing written
        membership = rdzv.join()
        assert membership is not None and membership.members == ("a",)
        rdzv.unreachable([("a", "b"), ("a", "c"), ("a", "a")])
        events = read_round(rdzv._store, membership.generation + 1)
        assert events.unreachable == frozenset({pair("a", "b"), pair("a", "c")})
        assert events.joined == ()  # a report is no join
    finally:
        rdzv.close()
    del server
