"""The members' link checks (`elastic.recovery.links`): every member's findings read alike by all, and the
wait of a participant that the largest-set rule leaves out. Listeners on loopback, an in-memory store."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from elastic import ElasticError
from elastic.recovery.links import Cut, Links, probe_seconds
from elastic.recovery.reach import ANSWER, publish


class Rdzv:
    """What `Links` asks of the rendezvous: progress, who is gone, who is alive."""

    def __init__(self, alive: set[str] | None = None, gone: set[str] | None = None) -> None:
        self.alive_set = alive if alive is not None else set()
        self.gone = gone or set()
        self.progressed = 0
        self.grace = 1.0

    def progress(self) -> None:
        self.progressed += 1

    def exited(self) -> set[str]:
        return set(self.gone)

    def expired(self, within: float | None = None) -> list[str]:
        return []

    def alive(self) -> set[str]:
        return set(self.alive_set)


def _refused() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def three() -> Iterator[tuple[Any, list[Links]]]:
    store = dist.HashStore()
    links = [Links(store, "run", name, timeout=0.5, host="127.0.0.1") for name in ("a", "b", "c")]
    yield store, links
    for one in links:
        one.close()


def test_probe_seconds_is_a_tenth_of_timeout_within_one_and_two() -> None:
    assert [probe_seconds(t) for t in (0.3, 5, 15, 60)] == [0.3, 1.0, 1.5, 2.0]


def test_every_member_reads_every_finding_and_a_pair_seen_from_one_side_is_known_to_both(
    three: tuple[Any, list[Links]],
) -> None:
    store, links = three
    members = ("a", "b", "c")
    gen = dist.PrefixStore("gen0", store)
    # all connect: nobody's finding, complete, fast
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        found = list(
            pool.map(
                lambda r: links[r].find(gen, "form", members, r, range(3), rdzv=Rdzv(), wait=5), range(3)
            )
        )
    assert all(f.complete and not f.cut for f in found)
    # b's listener is gone from a's point of view only (its address, as a sees it, refuses)
    links[0]._addresses["b"] = _refused()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        found = list(
            pool.map(
                lambda r: links[r].find(gen, "again", members, r, range(3), rdzv=Rdzv(), wait=5), range(3)
            )
        )
    assert all(f.complete for f in found)
    assert (
        found[0].cut.found == found[1].cut.found == found[2].cut.found == {("a", "b"): "connection refused"}
    )
    cut = found[2].cut
    assert cut.pairs == frozenset({frozenset({"a", "b"})})
    assert cut.found_by("a") == [("a", "b")] and cut.found_by("b") == []
    assert cut.peers_of("b") == {"a"}
    text = cut.describe(members)
    assert text.startswith("'a' (127.0.0.1:") and "rank 0) cannot connect to 'b' (127.0.0.1:" in text
    assert text.endswith("rank 1) (connection refused)")


def test_a_member_that_never_posts_makes_the_findings_incomplete(three: tuple[Any, list[Links]]) -> None:
    store, links = three
    gen = dist.PrefixStore("gen1", store)
    started = time.monotonic()
    found = links[0].find(gen, "form", ("a", "b", "c"), 0, range(3), rdzv=Rdzv(), wait=0.3)
    assert not found.complete and not found.cut and time.monotonic() - started < 2
    # one that is known gone ends the wait at once, and is named
    found = links[0].find(gen, "other", ("a", "b", "c"), 0, range(3), rdzv=Rdzv(gone={"c"}), wait=30)
    assert not found.complete and found.missing == (2,)
    # only the expected ranks are waited for
    found = links[0].find(gen, "solo", ("a", "b", "c"), 0, {0}, rdzv=Rdzv(), wait=30)
    assert found.complete and not found.cut


def test_both_directions_read_as_one_pair() -> None:
    cut = Cut(
        {("a", "b"): "connect timed out after 1 s", ("b", "a"): "connect timed out after 1 s"}, {"a": "h:1"}
    )
    assert cut.describe(("a", "b")) == (
        "'a' (h:1, rank 0) and 'b' (address unknown, rank 1) cannot connect to each other "
        "(connect timed out after 1 s, both ways)"
    )
    assert not Cut() and cut


def test_a_participant_left_out_waits_until_its_peer_is_reachable_gone_or_join_timeout() -> None:
    store = dist.HashStore()
    members = ("a", "me")
    peer = socket.socket()  # "a": bound, not listening yet: connections are refused until it listens
    peer.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{peer.getsockname()[1]}"
    publish(store, "run", "a", address)
    me = Links(store, "run", "me", timeout=0.3, host="127.0.0.1")
    cut = Cut({("me", "a"): "connect timed out after 0.3 s"}, {"a": address, "me": me.listener.address})
    both = Rdzv(alive={"a", "me"})
    try:
        # the rule keeps "a" (first in the members' order): "me" waits, then raises naming the pair
        started = time.monotonic()
        with pytest.raises(ElasticError) as info:
            me.wait(cut, members, rdzv=both, join_timeout=0.5, finished=lambda: False)
        assert 0.5 <= time.monotonic() - started < 2.5
        text = str(info.value)
        assert f"'me' ({me.listener.address}, rank 1) cannot connect to 'a' ({address}, rank 0)" in text
        assert "join_timeout=0.5 s" in text and "GLOO_SOCKET_IFNAME" in text
        assert both.progressed > 0  # it kept heartbeating while it waited
        # the peer is gone (its heartbeat stopped): no reason to wait
        me.wait(cut, members, rdzv=Rdzv(alive={"me"}), join_timeout=30, finished=lambda: False)
        # the run finished meanwhile: nothing to wait for
        me.wait(cut, members, rdzv=both, join_timeout=30, finished=lambda: True)

        # the link heals: the peer listens and answers; "me" rejoins within about a retry
        def listen_later() -> None:
            time.sleep(0.5)
            peer.listen(4)
            while True:
                try:
                    conn, _ = peer.accept()
                except OSError:
                    return
                with conn:
                    conn.sendall(ANSWER + b"a\n")

        threading.Thread(target=listen_later, daemon=True).start()
        started = time.monotonic()
        me.wait(cut, members, rdzv=both, join_timeout=30, finished=lambda: False)
        assert 0.4 < time.monotonic() - started < 3
    finally:
        me.close()
        peer.close()
