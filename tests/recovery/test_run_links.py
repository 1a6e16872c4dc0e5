"""`elastic.run`'s side of pairs that cannot connect (in process, no worker processes): the bounded group
formation, `_judge` asking the members' links before it calls a failure nobody's, and what a member does
before it rejoins (report; wait outside when the largest-set rule leaves it out)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import attrs
import pytest
import torch.distributed as dist

import elastic.recovery.run as _run
from elastic import ElasticError
from elastic.recovery.links import Cut, Links
from elastic.recovery.reach import publish


@attrs.frozen
class Membership:
    generation: int = 3
    rank: int = 0
    size: int = 2
    members: tuple[str, ...] = ("a", "b")
    prefix: str = "elastic/test/pg/3/"


class Rdzv:
    def __init__(self, participant: str = "a", alive: set[str] | None = None) -> None:
        self.participant = participant
        self.run_id = "run"
        self.join_timeout = 0.5
        self.expiry = 0.02
        self.reported: list[list[tuple[str, str]]] = []
        self._alive = alive if alive is not None else {"a", "b"}

    def progress(self) -> None:
        pass

    def alive(self) -> set[str]:
        return set(self._alive)

    def unreachable(self, pairs: Any) -> None:
        self.reported.append(list(pairs))


def test_gloo_formation_gets_a_fifth_of_timeout_within_one_second_and_timeout() -> None:
    got = [_run._init_timeout(timedelta(seconds=s)).total_seconds() for s in (0.3, 3, 5, 60)]
    assert got == [0.3, 1.0, 1.0, 12.0]


def test_the_group_forms_while_the_rendezvous_holds_the_heartbeat() -> None:
    held: list[str] = []

    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        held.append("in")
        yield
        held.append("out")

    one = Membership(size=1, members=("a",), prefix="links/p1/")
    try:
        _run._new_group(dist.HashStore(), one, "gloo", timedelta(seconds=10), hold=hold)
        assert held == ["in", "out"]
    finally:
        _run._end_group(abort=False)


def test_judge_asks_the_links_before_it_calls_a_failure_nobodys() -> None:
    timed_out = RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    asked: list[set[int]] = []

    def cut(ranks: set[int]) -> str | None:
        asked.append(ranks)
        return "members cannot connect to each other: 'a' and 'b' (connect timed out after 1 s, both ways)"

    store = dist.HashStore()
    gen, peer = _run._Generation(store, Membership()), _run._Generation(store, Membership(rank=1))
    peer.record(_run.IN_FN)
    gen.record(_run.IN_FN)
    verdict = _run._judge(timed_out, Rdzv(), gen, 5.0, timedelta(seconds=5), links=cut)
    assert verdict == _run.REGROUP + cut(set())
    assert asked[0] == {0, 1}  # the members that failed too
    assert peer.verdict(None) == verdict  # everyone's
    # every pair connects: nobody's failure, as before
    store = dist.HashStore()
    gen, peer = _run._Generation(store, Membership()), _run._Generation(store, Membership(rank=1))
    peer.record(_run.IN_FN)
    gen.record(_run.IN_FN)
    assert _run._judge(timed_out, Rdzv(), gen, 5.0, timedelta(seconds=5), links=lambda _r: None) == _run.OWN


def _loop(rdzv: Rdzv, store: Any, links: Links | None) -> Any:
    return _run._Loop(
        fn=lambda s, w: None,
        state=None,
        store=store,
        rendezvous=rdzv,
        departure=_run._Departure(),
        backend="gloo",
        ckpt=None,
        timeout=timedelta(seconds=5),
        check_every=1,
        links=links,
    )


def test_before_rejoining_a_member_reports_its_pairs_and_the_side_left_out_waits() -> None:
    store = dist.HashStore()
    with socket.socket() as nobody:  # "a"'s listener, as "b" sees it: refused
        nobody.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{nobody.getsockname()[1]}"
        publish(store, "run", "a", address)
        found = {("a", "b"): "connect timed out after 1 s", ("b", "a"): "connect timed out after 1 s"}
        cut = Cut(found, {"a": address, "b": "127.0.0.1:2"})
        # "a" stays (first in the members' order): it reports what it found and rejoins at once
        keeper = Rdzv("a")
        loop = _loop(keeper, store, None)
        loop._note_cut(cut, Membership())
        loop.rejoin()
        assert keeper.reported == [[("a", "b")]] and loop.cut is None
        # "b" is left out: it reports, then waits for "a"; after join_timeout it raises naming the pair
        left = Rdzv("b")
        links = Links(store, "run", "b", timeout=0.3, host="127.0.0.1")
        try:
            loop = _loop(left, store, links)
            loop._note_cut(cut, Membership(rank=1))
            started = time.monotonic()
            with pytest.raises(ElasticError, match=r"'b' \(127\.0\.0\.1:2, rank 1\) is left out"):
                loop.rejoin()
            assert time.monotonic() - started >= 0.5
            assert left.reported == [[("b", "a")]]
            # "a" is gone meanwhile: no wait
            loop = _loop(Rdzv("b", alive={"b"}), store, links)
            loop._note_cut(cut, Membership(rank=1))
            loop.rejoin()
        finally:
            links.close()


def test_a_join_that_fails_after_a_cut_says_so() -> None:
    class Failing(Rdzv):
        def join(self) -> Any:
            msg = "elastic: participant 'a': no generation formed within join_timeout=1 s"
            raise ElasticError(msg)

    loop = _loop(Failing("a"), dist.HashStore(), None)
    loop.last_cut = (Cut({("a", "b"): "connection refused"}, {}), ("a", "b"))
    with pytest.raises(ElasticError, match=r"join_timeout=1 s \(the last generation ended because 'a' "):
        loop.run()
