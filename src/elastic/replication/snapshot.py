"""In-memory snapshots of a sharded state: this rank's pieces in CPU memory, and a copy on one peer.

`Snapshots` lives across the generations of ``elastic.run(fn, build, snapshot_every=k)``. Every k-th
``world.check()`` (`Snapshots.take`) it copies this rank's pieces and the state's plain leaves into one CPU
buffer: the only part that blocks the step. A background thread then sends that buffer to the next shard
position of a ring (`ring_peers`: one peer outside this rank's replica set) on a gloo group of the
generation's own, receives the previous position's buffer, and *commits* the round with a one-element
all-reduce once every rank of the ring has installed its copy.

What counts. An entry (this rank's own pieces, or a peer's copy) is a `Held` offered to
`elastic.replication.reshard` only when it is complete on its holder, with its tenure: its own pieces once
the device-to-host copy is done, a peer's copy once all of its bytes have arrived and its header is read
(a half-received buffer is never installed). The previous round is dropped only when the new one commits,
that is when every rank holds its copy; a fault while a round is in flight leaves the previous round
(complete everywhere) to fall back on. So at most two rounds are kept, each of them this rank's own pieces
and one peer's copy: at rest about twice this rank's share of the state's tensors in CPU memory, four
times while a round is in flight (a third, rarely: a newer round held in full whose commit this rank did
not see, since a peer may have). Every rank takes every round, so that the ring's messages (tagged by the
round's number in the generation) and all-reduces pair up: a failed copy or a torn state sends an empty
buffer and withholds the commit. A round has one deadline, one `timeout` from its start; a round still in
flight at the next snapshot is waited for until then (sending one took longer than k steps: raise k). A
round that fails is not committed (a warning); training goes on. A round abandoned with its generation
installs nothing more, and its group is aborted.

The ring survives the loss of workers no two of which are neighbours on it (one at a time, always): the
lost rank's pieces are the copy its successor holds.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
import cloudpickle
import torch
import torch.distributed as dist

from elastic.replication.reshard import Held, Region, region_of
from elastic.state.shards import Layout, pieces, plain_leaves, sharded_state_dict
from elastic.state.tenure import greater, order_key

__all__ = ["Snapshots", "ring_peers"]

log = logging.getLogger("elastic")

#: Byte alignment of every piece in a snapshot buffer (any dtype can be viewed at such an offset).
_ALIGN = 64
_LENGTH = struct.Struct("<q")


def ring_peers(layout: Layout, me: int) -> tuple[int, int] | None:
    """(the rank this rank sends its pieces to, the rank it receives a copy from): the same replica index
    at the next and the previous shard position. None when the mesh has a single shard position (every
    rank holds whole pieces: nothing to copy elsewhere)."""
    positions = layout.positions
    if len(positions) < 2:
        return None
    at = {pos: sorted(r for r, p in layout.position.items() if p == pos) for pos in positions}
    j = positions.index(layout.position[me])
    index = at[positions[j]].index(me)
    following = at[positions[(j + 1) % len(positions)]]
    preceding = at[positions[(j - 1) % len(positions)]]
    return following[index % len(following)], preceding[index % len(preceding)]


@attrs.frozen
class _Header:
    """What a snapshot buffer starts with: enough to rebuild the `Held` on any rank."""

    tenure: Any
    layout: int
    rank: int
    regions: tuple[Region, ...]
    offsets: tuple[int, ...]
    plain: Any


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _dtype(region: Region) -> torch.dtype:
    dtype: torch.dtype = getattr(torch, region.dtype.removeprefix("torch."))
    return dtype


def _nbytes(region: Region) -> int:
    return math.prod(region.shape) * torch.empty((), dtype=_dtype(region)).element_size()


def _views(buf: torch.Tensor, header: _Header, start: int) -> list[torch.Tensor]:
    """The pieces in `buf` (its data starting at byte `start`), as tensors of their dtypes and shapes."""
    out = []
    for region, at in zip(header.regions, header.offsets):
        part = buf[start + at : start + at + _nbytes(region)]
        out.append(part.view(_dtype(region)).view(region.shape))
    return out


def pack(state: Any, tenure: Any, layout: int, rank: int) -> tuple[Held, torch.Tensor]:
    """This rank's pieces and plain leaves of `state` copied into one CPU buffer (the device-to-host
    copy): `pack_pieces` of the state's pieces."""
    with torch.no_grad():
        sd = sharded_state_dict(state)
        own = pieces(sd)
        plain = cloudpickle.loads(cloudpickle.dumps(plain_leaves(sd)))  # a copy: training goes on
        return pack_pieces([region_of(p) for p in own], [p.local for p in own], plain, tenure, layout, rank)


def pack_pieces(
    regions: Sequence[Region],
    tensors: Sequence[torch.Tensor],
    plain: Any,
    tenure: Any,
    layout: int,
    rank: int,
) -> tuple[Held, torch.Tensor]:
    """`tensors` (the local pieces of `regions`) copied into one CPU buffer, as a `Held` whose tensors are
    views into it; the buffer is what travels to the peer: the header's length, the header (`_Header`,
    pickled: tenure, layout, rank, regions, offsets, `plain`), then every piece at an aligned offset."""
    offsets, size = [], 0
    for region in regions:
        offsets.append(size)
        size = _aligned(size + _nbytes(region))
    header = _Header(tenure, layout, rank, tuple(regions), tuple(offsets), plain)
    blob = _LENGTH.pack(len(head := cloudpickle.dumps(header))) + head
    start = _aligned(len(blob))
    buf = torch.empty(start + size, dtype=torch.uint8)
    buf[: len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    views = _views(buf, header, start)
    with torch.no_grad():
        for target, local in zip(views, tensors):
            target.copy_(local)
    return Held(tenure, list(regions), views, plain, layout=layout, snapshot="own"), buf


def unpack(buf: torch.Tensor) -> Held:
    """The `Held` a snapshot buffer holds (a peer's copy), its tensors views into `buf`."""
    raw = buf.numpy()
    (length,) = _LENGTH.unpack(raw[: _LENGTH.size].tobytes())
    header: _Header = cloudpickle.loads(raw[_LENGTH.size : _LENGTH.size + length].tobytes())
    return Held(
        header.tenure,
        list(header.regions),
        _views(buf, header, _aligned(_LENGTH.size + length)),
        header.plain,
        layout=header.layout,
        snapshot=f"copy of rank {header.rank}",
    )


@attrs.define
class _Entry:
    held: Held
    round: int
    committed: bool = False


@attrs.frozen
class _Ring:
    """One generation's ring: its gloo group (``send``/``recv``/``allreduce`` of a torch ProcessGroup),
    this rank, its peers, the layout its pieces belong to, and the bound of a whole round."""

    group: Any
    rank: int
    following: int
    preceding: int
    layout: int
    timeout: timedelta


@attrs.define
class _Round:
    """A round in flight: its thread, the time (``time.monotonic()``) by which it ends, its ring's
    timeout."""

    thread: threading.Thread
    deadline: float
    timeout: float


#: What a join past a round's deadline adds (its thread's last wait returns at the deadline).
_GRACE = 1.0


class Snapshots:
    """This rank's snapshots across generations (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._ring: _Ring | None = None
        self._flight: _Round | None = None
        #: a round abandoned with its generation (its group aborted), joined briefly by the next `open`
        self._abandoned: _Round | None = None
        self._round = 0  # across generations: which entries are newer
        self._ring_round = 0  # within the ring's generation: alike on every rank (the messages' tags)

    @property
    def _thread(self) -> threading.Thread | None:
        return None if self._flight is None else self._flight.thread

    # -- a generation's ring

    def open(
        self, group: Any, rank: int, peers: tuple[int, int] | None, layout: int, timeout: timedelta
    ) -> None:
        """Snapshot on `group` from now on (None peers: nothing to send; snapshots are skipped)."""
        self.close(wait=False)
        gone = self._abandoned
        if gone is not None:
            gone.thread.join(min(timeout.total_seconds(), _GRACE))
            if gone.thread.is_alive():
                log.warning(
                    "snapshots: the thread of an abandoned round is still running (its group aborted)"
                )
            self._abandoned = None
        self._ring_round = 0
        if peers is None:
            log.info("snapshots: the mesh has one shard position (every rank holds whole pieces); none taken")
            return
        self._ring = _Ring(group, rank, peers[0], peers[1], layout, timeout)

    def close(self, *, wait: bool) -> None:
        """The generation ends: with `wait`, let the round in flight finish (every rank is alive and ends
        alike; at most its deadline, one `timeout` from its start); else abandon it: what it has not
        installed yet is never installed, and its group is aborted so that its sockets close."""
        flight, ring = self._flight, self._ring
        if flight is not None and ring is not None:
            if wait:
                _join(flight)
                if flight.thread.is_alive():
                    log.warning(
                        "snapshots: round %d did not end within its timeout of %s; abandoning it",
                        self._ring_round,
                        ring.timeout,
                    )
            if flight.thread.is_alive():
                _abort(ring.group)
                self._abandoned = flight
        with self._lock:
            self._ring = None
            self._flight = None

    # -- rounds

    def take(self, state: Any, tenure: Any) -> None:
        """A new round: wait for the previous one (at most until its deadline), copy this rank's pieces to
        the CPU, and send them to the ring's next position in the background. Every rank takes every
        round: a failure (of the copy, or a state torn: `tenure` None) sends an empty buffer and withholds
        the commit, so that the ring's messages and all-reduces still pair up."""
        ring = self._ring
        if ring is None:
            return
        previous = self._flight
        if previous is not None:
            _join(previous)  # a round still running (past its deadline) is chained on, not skipped
        self._round += 1
        self._ring_round += 1
        with self._lock:
            self._entries = self._keep_newest()
        ok, buf = tenure is not None, torch.empty(0, dtype=torch.uint8)
        if ok:
            try:
                own, buf = pack(state, tenure, ring.layout, ring.rank)
            except Exception as exc:
                log.warning(
                    "snapshots: copying this rank's pieces failed (%s: %s); round %d will not commit",
                    type(exc).__name__,
                    exc,
                    self._ring_round,
                )
                ok = False
            else:
                with self._lock:
                    self._entries.append(_Entry(own, self._round))
        deadline = time.monotonic() + ring.timeout.total_seconds()
        thread = threading.Thread(
            target=self._exchange,
            args=(ring, self._round, self._ring_round, buf, ok, tenure, deadline, previous),
            name="elastic-snapshot",
            daemon=True,
        )
        self._flight = _Round(thread, deadline, ring.timeout.total_seconds())
        thread.start()

    def _keep_newest(self) -> list[_Entry]:
        """What a new round keeps: the newest committed round (else nothing older than the newest round)
        and every newer round this rank holds in full (its own pieces and a copy: a peer may have seen it
        commit when this rank did not)."""
        committed = max((e.round for e in self._entries if e.committed), default=None)
        if committed is None:
            newest = max((e.round for e in self._entries), default=None)
            return [e for e in self._entries if e.round == newest]
        full = _full_rounds(self._entries)
        return [e for e in self._entries if e.round == committed or (e.round > committed and e.round in full)]

    def _exchange(
        self,
        ring: _Ring,
        number: int,
        ring_round: int,
        buf: torch.Tensor,
        ok: bool,
        tenure: Any,
        deadline: float,
        previous: _Round | None,
    ) -> None:
        if previous is not None:  # the ring's operations stay in order on every rank
            previous.thread.join()
        group, failure = ring.group, None
        installed = False
        tags = 2 * ring_round, 2 * ring_round + 1  # a late message of an earlier round never pairs here
        try:
            size = torch.tensor([buf.numel()], dtype=torch.int64)
            theirs = torch.empty(1, dtype=torch.int64)
            sent = group.send([size], ring.following, tags[0])
            _wait(group.recv([theirs], ring.preceding, tags[0]), deadline)
            incoming = torch.empty(int(theirs.item()), dtype=torch.uint8)
            sent_buf = group.send([buf], ring.following, tags[1])
            _wait(group.recv([incoming], ring.preceding, tags[1]), deadline)
            _wait(sent, deadline)
            _wait(sent_buf, deadline)
            if incoming.numel() == 0:
                msg = f"rank {ring.preceding} sent no snapshot (its copy failed or its state is torn)"
                raise RuntimeError(msg)
            copy = unpack(incoming)
            if copy.layout != ring.layout or order_key(copy.tenure) != order_key(tenure):
                msg = (
                    f"rank {ring.preceding} sent a snapshot of tenure {copy.tenure!r} on layout "
                    f"{copy.layout}; this round is of tenure {tenure!r} on layout {ring.layout}"
                )
                raise RuntimeError(msg)
            with self._lock:
                if ok and self._ring is ring:  # not abandoned: the copy counts from now on
                    self._entries.append(_Entry(copy, number))
                    installed = True
        except Exception as exc:
            failure = exc
        try:  # commit, collectively: every rank installed its copy (a rank that did not says 0)
            flag = torch.tensor([1 if installed else 0], dtype=torch.int32)
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
            _wait(group.allreduce([flag], opts), deadline)
            committed = bool(flag.item())
        except Exception as exc:
            failure = failure or exc
            committed = False
        with self._lock:
            if committed and self._ring is ring:
                for e in self._entries:
                    e.committed = e.round == number
                self._entries = [e for e in self._entries if e.round == number]
                log.debug("snapshots: round %d committed", ring_round)
        if failure is not None and self._ring is ring:
            log.warning(
                "snapshots: round %d was not committed (%s: %s)", ring_round, type(failure).__name__, failure
            )
        elif not committed and self._ring is ring:
            log.warning("snapshots: round %d was not committed (a rank lacks its copy)", ring_round)

    # -- what the next generation reads

    def held(self) -> list[Held]:
        """The complete snapshots this rank holds (its own pieces and peers' copies)."""
        with self._lock:
            return [e.held for e in self._entries]

    def settle(self, tenure: Any, from_snapshot: bool) -> None:
        """A new state was filled at `tenure` (`from_snapshot`: from snapshots of that tenure): drop what
        is more tenured (a timeline given up), and when the snapshots were used, every other round."""
        with self._lock:
            if from_snapshot:
                keep = [e for e in self._entries if order_key(e.held.tenure) == order_key(tenure)]
                for e in keep:
                    e.committed = True
                self._entries = keep
            else:
                self._entries = [e for e in self._entries if not greater(e.held.tenure, tenure)]

    @property
    def nbytes(self) -> int:
        """The bytes of CPU memory the kept snapshots take."""
        with self._lock:
            return sum(t.numel() * t.element_size() for e in self._entries for t in e.held.tensors)


def _full_rounds(entries: Sequence[_Entry]) -> set[int]:
    """The rounds of `entries` held in full: this rank's own pieces and a peer's copy."""
    own = {e.round for e in entries if e.held.snapshot == "own"}
    return {e.round for e in entries if e.held.snapshot != "own" and e.round in own}


def _wait(work: Any, deadline: float) -> None:
    """`work` done by `deadline` (a gloo wait that times out raises; the operation stays pending)."""
    work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


def _join(flight: _Round) -> None:
    """Wait for a round's thread until just past its deadline, at most one timeout (heartbeats go on)."""
    flight.thread.join(min(max(flight.deadline - time.monotonic(), 0.0) + _GRACE, flight.timeout))


def _abort(group: Any) -> None:
    """Abort an abandoned round's group, so that its pending operations fail where the backend can (gloo's
    abort in torch 2.13 does not unblock a pending receive: the round's deadline ends its thread, within
    one timeout, and the group's sockets close with its last reference)."""
    try:
        group.abort()
    except Exception as exc:  # the group may be gone already (the generation's end destroys it)
        log.debug("snapshots: aborting the ring's group: %s", exc)
