"""The round protocol of `elastic.run`: who is in the next generation, decided once, over a TCPStore.

The protocol is written down, with its properties and their argument, in docs/rendezvous.md; a model of
it is docs/rendezvous.pml, and tests/recovery/test_rendezvous.py drives `step` (the protocol's whole decision
logic, one store operation per call) through every interleaving of a few participants.

Keys, under ``elastic/<run_id>/`` in the store:

- ``hb/<p>``: participant p's heartbeat counter, incremented every `period` by a thread of p while p
  made progress within `timeout` (a hung process stops beating, a dead one too).
- ``r/<n>``: the log of round n, appended to and never rewritten: ``+p,`` (p joins round n), ``~p,``
  (p, a member of generation n-1, announced it is on its way), ``-p,`` (p leaves for good), ``=a|b|c,``
  (a proposal: members in rank order), ``!,`` (the run finished). The FIRST proposal in the log is the
  decision of round n, generation n: the store orders appends, so every reader sees the same one.
- ``next``: a hint, a round such that every lower round is decided (participants scan up from it).
- ``finished``: set when a generation's function returned; later joiners get None.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Protocol, TypeVar, cast

import attrs
import torch.distributed as dist

from elastic._util.errors import ElasticError
from elastic._util.procs import running
from elastic.recovery.partition import largest_reachable

__all__ = [
    "Joiner",
    "Log",
    "Membership",
    "Rendezvous",
    "decide",
    "parse_log",
    "pending_from",
    "start",
    "step",
]

log = logging.getLogger("elastic")

FINISHED = "finished"
NEXT = "next"


def log_key(n: int) -> str:
    return f"r/{n}"


def hb_key(p: str) -> str:
    return f"hb/{p}"


def where_key(p: str) -> str:
    return f"where/{p}"


def process_space() -> str:
    """What two processes must share for one to see the other's pid: the boot (``boot_id``) and the pid
    namespace. Empty where that cannot be told (no ``/proc``): then only heartbeats judge liveness."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


class Ops(Protocol):
    """The store operations the protocol uses (a torch Store has them; tests use an in-memory one)."""

    def check(self, keys: list[str]) -> bool: ...
    def set(self, key: str, value: str) -> None: ...
    def add(self, key: str, value: int) -> int: ...
    def append(self, key: str, value: str) -> None: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


def read(store: Ops, key: str) -> bytes:
    """The value of `key`, created empty when missing: one operation that never blocks."""
    return store.compare_set(key, "", "")


@attrs.frozen
class Membership:
    """This participant's place in a generation, identical on every member but for `rank`."""

    generation: int
    rank: int
    size: int
    members: tuple[str, ...]
    prefix: str


@attrs.frozen
class Log:
    """A round's log: who joined (in order of first join), who announced or left, the decision (the
    first proposal; None: undecided), whether the run finished, and the pairs reported unable to connect."""

    joined: tuple[str, ...] = ()
    announced: frozenset[str] = frozenset()
    left: frozenset[str] = frozenset()
    decision: tuple[str, ...] | None = None
    finished: bool = False
    unreachable: frozenset[frozenset[str]] = frozenset()


def parse_log(raw: bytes) -> Log:
    """The `Log` of a round from its ``+p,`` ``~p,`` ``-p,`` ``=a|b,`` ``!,`` ``xa|b,`` tokens."""
    joined: dict[str, None] = {}
    announced: set[str] = set()
    left: set[str] = set()
    unreachable: set[frozenset[str]] = set()
    decision: tuple[str, ...] | None = None
    finished = False
    for token in raw.decode().split(","):
        kind, name = token[:1], token[1:]
        if kind == "+":
            joined.setdefault(name, None)
        elif kind == "~":
            announced.add(name)
        elif kind == "-":
            left.add(name)
        elif kind == "=" and decision is None:
            decision = tuple(name.split("|"))
        elif kind == "!":
            finished = True
        elif kind == "x" and len(pair := frozenset(name.split("|"))) == 2:
            unreachable.add(pair)  # xa|b: a cannot connect to b
    return Log(
        joined=tuple(p for p in joined if p not in left),
        announced=frozenset(announced),
        left=frozenset(left),
        decision=decision,
        finished=finished,
        unreachable=frozenset(unreachable),
    )


def decide(
    prev: tuple[str, ...],
    events: Log,
    *,
    alive: Callable[[str], bool],
    ready: Callable[[str], bool],
    min_workers: int,
    max_workers: int,
    quiet: bool,
    fit: Callable[[int], int] | None = None,
) -> tuple[str, ...] | None:
    """The membership to propose for a round, or None to wait.

    `prev` are the members of the previous generation, `events` the round's log so far; in this
    proposer's view of the heartbeats, `alive(p)`: p may still come (its heartbeat is fresh), `ready(p)`:
    p may be a member (fresh and seen beating); `quiet`: the log has not changed for a last call.

    Members: the joined participants that are ready, at most `max_workers` (previous members are chosen
    first, in their previous rank order, then newcomers in join order), ranked by the stable order their
    ids carry (`ranked`; with `fit`, previous members keep their ranks: `_ranks`). The round closes as
    soon as every live previous member has joined and every live joiner is ready (no wait for the dead);
    a round no previous member has joined (the first, or after every member died) closes after a quiet
    last call, so that workers starting together form one generation. `fit(n)`: how many of `n` chosen
    workers a generation uses (a sharded state's mesh); the others stay out, as spares of the next round.
    """
    candidates = [p for p in events.joined if ready(p)]
    # pairs that cannot connect: only the largest set with none goes on, and the others (joined, or live
    # previous members that wait outside) are not waited for (docs/rendezvous.md, "Pairs that cannot connect")
    expected = candidates + [p for p in prev if p not in events.left and p not in candidates and alive(p)]
    cut = set(expected) - set(largest_reachable(expected, events.unreachable, prefer=prev))
    candidates = [p for p in candidates if p not in cut]
    ordered = [p for p in prev if p in candidates] + [p for p in candidates if p not in prev]
    missing = [p for p in prev if p not in events.left and p not in candidates and p not in cut and alive(p)]
    if missing and sum(p in prev for p in ordered) < max_workers:
        return None
    unsure = [p for p in events.joined if not ready(p) and alive(p)]
    if unsure and len(ordered) < max_workers:
        return None
    if len(ordered) >= max_workers:
        return _ranks(_fitted(ordered[:max_workers], fit), prev, fit)
    if len(ordered) < min_workers:
        return None
    if not any(p in prev for p in ordered) and not quiet:
        return None
    return _ranks(_fitted(ordered, fit), prev, fit)


def _ranks(chosen: list[str], prev: tuple[str, ...], fit: Callable[[int], int] | None) -> tuple[str, ...]:
    """`chosen` in rank order: `ranked`, except that with a mesh (`fit`) the previous members keep their
    ranks where they still exist and the others fill the free ranks in `ranked` order, so that when the
    mesh stays a survivor keeps its coordinate (and its pieces: the state is kept, not resharded)."""
    if fit is None or not prev:
        return ranked(chosen)
    places: list[str | None] = [None] * len(chosen)
    for p in chosen:
        if p in prev and prev.index(p) < len(chosen):
            places[prev.index(p)] = p
    rest = iter(ranked([p for p in chosen if p not in places]))
    return tuple(p if p is not None else next(rest) for p in places)


def _fitted(ordered: list[str], fit: Callable[[int], int] | None) -> list[str]:
    """The first `fit(len(ordered))` of `ordered` (previous members come first there)."""
    if fit is None:
        return ordered
    return ordered[: max(1, min(len(ordered), fit(len(ordered))))]


def order_of(p: str) -> int | None:
    """The stable order a participant id carries (``"<n>.<rest>"``: its launcher slot or rank), or None."""
    head, dot, _ = p.partition(".")
    return int(head) if dot and head.isdigit() else None


def ranked(chosen: list[str]) -> tuple[str, ...]:
    """`chosen` in rank order: by the stable order the ids carry (`order_of`: a slot, a launcher rank), so
    that two runs started alike rank their workers alike whatever order they joined in (the election
    breaks tenure ties by rank); ids without one keep their order, after those with one."""

    def key(item: tuple[int, str]) -> tuple[bool, int, int]:
        order = order_of(item[1])
        return (order is None, order if order is not None else 0, item[0])

    return tuple(p for _, p in sorted(enumerate(chosen), key=key))


def pending_from(
    raw: bytes, members: tuple[str, ...], max_workers: int, fit: Callable[[int], int] | None = None
) -> bool:
    """Should generation `members` end at its next check, seen from the next round's log `raw`?

    Yes when the next round is decided (this generation is stale) or the run finished, when a member
    left, announced or went on to the next round, or when a newcomer waits and the generation has room.
    """
    ev = parse_log(raw)
    if ev.decision is not None or ev.finished:
        return True
    if any(p in ev.left or p in ev.announced or p in ev.joined for p in members):
        return True
    if not ev.joined or len(members) >= max_workers:
        return False
    if fit is None:
        return True
    # a sharded state's mesh may have no use for the newcomers (spares): the generation goes on
    return fit(min(max_workers, len(members) + len(ev.joined))) > len(members)


@attrs.frozen
class Joiner:
    """A participant's progress through `join`: the protocol as a state machine, one store op per step.

    phase: ``fin`` (is the run finished?), ``hint`` (read ``next``), ``scan`` (read the round's log;
    skip it when decided), ``append`` (``+me``), ``prev`` (read the previous round's decision), ``poll``
    (read the log: decided? finished? else maybe propose), ``propose`` (append the proposal), ``hinted``
    (rank 0 of the decision advances ``next``), ``done``.
    """

    me: str
    phase: str
    round: int
    prev: tuple[str, ...] = ()
    proposal: tuple[str, ...] = ()
    decision: tuple[str, ...] = ()
    finished: bool = False


def start(me: str, generation: int) -> Joiner:
    """A join by `me`, last a member of `generation` (-1: never)."""
    return Joiner(me=me, phase="fin", round=generation + 1)


Propose = Callable[[int, tuple[str, ...], Log], "tuple[str, ...] | None"]


def _decided(j: Joiner, members: tuple[str, ...]) -> Joiner:
    if j.me not in members:
        # A straggler: this round formed without it; it is a newcomer of the next one.
        return Joiner(me=j.me, phase="fin", round=j.round + 1)
    if members[0] == j.me:
        return attrs.evolve(j, phase="hinted", decision=members, proposal=())
    return attrs.evolve(j, phase="done", decision=members, proposal=())


def step(j: Joiner, store: Ops, propose: Propose) -> Joiner:
    """One store operation of participant `j`'s join; `propose(round, prev, log)` judges.

    The result's phase is ``done`` with `decision` (generation `round`'s members, `me` among them) or
    `finished` set; otherwise call again (after a short sleep when the phase is ``poll`` again).
    """
    if j.phase == "fin":
        if store.check([FINISHED]):
            return attrs.evolve(j, phase="done", finished=True)
        return attrs.evolve(j, phase="hint")
    if j.phase == "hint":
        return attrs.evolve(j, phase="scan", round=max(j.round, store.add(NEXT, 0)))
    if j.phase == "scan":
        if parse_log(read(store, log_key(j.round))).decision is not None:
            return attrs.evolve(j, round=j.round + 1)
        return attrs.evolve(j, phase="append")
    if j.phase == "append":
        store.append(log_key(j.round), f"+{j.me},")
        return attrs.evolve(j, phase="prev" if j.round > 0 else "poll")
    if j.phase == "prev":
        prev = parse_log(read(store, log_key(j.round - 1))).decision
        return attrs.evolve(j, phase="poll", prev=prev or ())
    if j.phase == "poll":
        events = parse_log(read(store, log_key(j.round)))
        if events.decision is not None:
            return _decided(j, events.decision)
        if events.finished:
            return attrs.evolve(j, phase="done", finished=True)
        proposal = propose(j.round, j.prev, events)
        if proposal is None:
            return j
        return attrs.evolve(j, phase="propose", proposal=proposal)
    if j.phase == "propose":
        store.append(log_key(j.round), "=" + "|".join(j.proposal) + ",")
        return attrs.evolve(j, phase="poll", proposal=())
    if j.phase == "hinted":
        store.set(NEXT, str(j.round + 1))
        return attrs.evolve(j, phase="done")
    msg = f"elastic: rendezvous step in phase {j.phase!r}, which has no next step (a bug in elastic)"
    raise ValueError(msg)


def _seconds(value: timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


_STORE_ERRORS = (RuntimeError, OSError, ValueError)

T = TypeVar("T")


@attrs.define
class _View:
    """What a joiner saw of its round, for the last call and for error messages."""

    round: int = -1
    events: Log = Log()
    changed: float = 0.0
    prev: tuple[str, ...] = ()
    alive: tuple[str, ...] = ()


@attrs.define
class _Seen:
    """One participant's heartbeat counter as this participant observed it."""

    counter: int
    changed: float  # when this participant first saw the counter at its value (monotonic)
    confirmed: bool  # seen changing at least once: beating now, not just a key left behind


class Rendezvous:
    """One participant of the rounds of run `run_id` over `store` (see docs/rendezvous.md).

    `timeout`: a participant that made no `progress()` for that long stops heartbeating (counts as hung),
    and the store unreachable for that long is an error. Heartbeats every `period` (default: `timeout`/50
    within 0.05..0.1 s); a participant whose counter did not change for `expiry` (default 6 periods) is
    dead to the others, but one that `announce()`d it is on its way to the next round is waited for
    `grace` (default 5 expiries: its abort and garbage collection may hold the GIL for a while).
    `first_workers` (default `min_workers`): how many members the first generation (round 0) needs.
    `last_call` (default 1 s): how long a round that no previous member joined waits for more joiners
    once `min_workers` are there (closes at once with `max_workers`).
    """

    def __init__(
        self,
        store: dist.Store,
        run_id: str,
        participant: str,
        *,
        min_workers: int = 1,
        max_workers: int | None = None,
        first_workers: int | None = None,
        join_timeout: timedelta,
        timeout: timedelta,
        address: str = "",
        period: timedelta | None = None,
        expiry: timedelta | None = None,
        grace: timedelta | None = None,
        last_call: timedelta | None = None,
        fit: Callable[[int], int] | None = None,
    ) -> None:
        if not participant or any(c in participant for c in ",/") or participant[0] in "+-~":
            msg = (
                f"elastic: participant id {participant!r} must be non-empty, contain no ',' or '/' and not "
                f"start with '+', '-' or '~'; use for instance 'host-pid'"
            )
            raise ElasticError(msg)
        first = min_workers if first_workers is None else first_workers
        top = max_workers if max_workers is not None else first
        if not 1 <= min_workers <= first <= top:
            given = "" if first_workers is None else f", first_workers={first_workers}"
            msg = (
                f"elastic: min_workers={min_workers}{given}, max_workers={max_workers}: need 1 <= "
                f"min_workers <= first_workers <= max_workers"
            )
            raise ElasticError(msg)
        self.run_id = run_id
        self.participant = participant
        self.min_workers = min_workers
        self.max_workers = max_workers if max_workers is not None else 1 << 30
        self.first_workers = first_workers if first_workers is not None else min_workers
        self.join_timeout = _seconds(join_timeout)
        self.timeout = _seconds(timeout)
        self.address = address
        self.period = _seconds(period) if period is not None else min(0.1, max(0.05, self.timeout / 50))
        self.expiry = _seconds(expiry) if expiry is not None else 6 * self.period
        self.grace = _seconds(grace) if grace is not None else 5 * self.expiry
        self.last_call = _seconds(last_call) if last_call is not None else 1.0
        self.fit = fit
        self._base = store
        self._store = dist.PrefixStore(f"elastic/{run_id}/", store)
        self._beat_store: dist.Store | None = None
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}
        self._observed_at: float | None = None  # the last successful read of the heartbeat counters
        self._space = process_space()
        #: participant -> its pid when it runs in this process space (same boot, same pid namespace), or
        #: None when it runs elsewhere; participants not yet looked up are absent
        self._pids: dict[str, int | None] = {}
        self._last_progress = time.monotonic()
        self._held = 0  # > 0 while long local work counts as progress (`hold`)
        self._generation = -1
        self._members: tuple[str, ...] = ()
        self._pending = False
        self._left = False
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_down_since: float | None = None

    # ----------------------------------------------------------------------------------------- public

    @property
    def generation(self) -> int:
        """The last generation this participant was a member of (-1: none yet)."""
        return self._generation

    def progress(self) -> None:
        """The run loop is alive: keep heartbeating for another `timeout`."""
        self._last_progress = time.monotonic()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Long local work (a first ``torch.compile``, a long evaluation): heartbeat all along, as if
        progress were made continuously, until the block ends (nested blocks count)."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
            self.progress()

    def _making_progress(self, now: float) -> bool:
        return self._held > 0 or now - self._last_progress < self.timeout

    def exited(self) -> set[str]:
        """The members of the current generation known to have exited: participants of this process space
        (same boot and pid namespace) whose process is gone. Reads no store; empty for other hosts."""
        out = set()
        for p in self._members:
            pid = self._pids.get(p)
            if p != self.participant and pid is not None and not running(pid):
                out.add(p)
        return out

    def join(self) -> Membership | None:
        """Block until this participant is a member of a new generation and return it; None when the run
        is finished. ElasticError after `join_timeout` without a generation, or when the store is
        unreachable for `timeout`."""
        if self._left or self._closed:
            state = "left" if self._left else "closed"
            msg = (
                f"elastic: participant {self.participant!r} has {state} the rendezvous and cannot join "
                f"again; start a new participant"
            )
            raise ElasticError(msg)
        began = time.monotonic()
        deadline = began + self.join_timeout
        self.progress()
        self._retry(lambda: self._store.add(hb_key(self.participant), 1))
        if self._space:  # before this participant's first join event: peers look it up once they see one
            where = f"{self._space}|{os.getpid()}"
            self._retry(lambda: self._store.set(where_key(self.participant), where))
        self._start_thread()
        j = start(self.participant, self._generation)
        joined_at = -1
        view = _View()
        propose = self._proposer(view)
        ops = cast(Ops, self._store)
        while True:
            self.progress()
            before = j
            j = self._retry(functools.partial(step, j, ops, propose))
            if j.phase == "done":
                break
            if before.phase == "append":
                joined_at = j.round
            if j.phase == "poll" and j == before:
                if time.monotonic() > deadline:
                    if self.fit is not None and any(p in view.alive for p in view.prev):
                        # a spare: a generation trains without it; it waits for the next change
                        deadline = time.monotonic() + self.join_timeout
                    else:
                        raise self._join_timeout_error(j, view)
                time.sleep(min(0.02, self.period / 2))
        if j.finished:
            log.debug("rendezvous: %s: the run is finished, nothing to join", self.participant)
            return None
        members = j.decision
        with self._lock:
            self._generation = j.round
            self._members = members
            self._pending = False
        log.debug(
            "rendezvous: %s is rank %d of generation %d %s after %.3f s (joined round %d)",
            self.participant,
            members.index(self.participant),
            j.round,
            list(members),
            time.monotonic() - began,
            joined_at,
        )
        return Membership(
            generation=j.round,
            rank=members.index(self.participant),
            size=len(members),
            members=members,
            prefix=f"elastic/{self.run_id}/pg/{j.round}/",
        )

    def announce(self) -> None:
        """This member's generation is over for it and it will join the next round: tell the others now.

        Call it as soon as a collective failed, before the slow abort and destroy of the group (whose
        garbage collection can hold the GIL, and so the heartbeat, for half a second): the next round
        then waits for this member up to `grace` instead of `expiry`, and every member's `pending()`
        turns True. One store write; fails soft.
        """
        self._write(f"~{self.participant},", "announce its regroup")

    def pending(self) -> bool:
        """Someone waits to join, a member left or announced a regroup, or a newer generation formed: end
        this generation at the next check. Reads no store: the heartbeat thread refreshes it every
        `period`."""
        return self._pending

    def alive(self) -> set[str]:
        """The members of the current generation whose heartbeat is fresh (one store read; this
        participant counts while it makes progress)."""
        members = self._members
        others = [p for p in members if p != self.participant]
        with contextlib.suppress(*_STORE_ERRORS):
            self._observe(self._store, others)
        now = time.monotonic()
        fresh = {p for p in others if self._fresh(p, now, self.expiry)}
        if self.participant in members and self._making_progress(now):
            fresh.add(self.participant)
        return fresh

    def expired(self, within: float | None = None) -> list[str]:
        """The other members of the current generation that are gone as this participant last saw them:
        their process exited (same host), or their counter had not changed for `within` seconds (default
        `expiry`) when the heartbeat thread last read the counters. Reads no store. Judged at the reads,
        not now: a participant whose own heartbeat thread was held up (the GIL, an unreachable store) sees
        nobody expire until it reads again, so it never blames its peers for its own stall."""
        with self._lock:
            members, observed = self._members, self._observed_at
            seen = dict(self._seen)
        exited = self.exited()
        limit = self.expiry if within is None else within
        out = []
        for p in members:
            if p == self.participant:
                continue
            last = seen.get(p)
            if p in exited or (last is not None and observed is not None and observed - last.changed > limit):
                out.append(p)
        return out

    def leave(self) -> None:
        """A planned departure: the others end the generation at their next check and go on without it."""
        self._left = True
        self._write(f"-{self.participant},", "announce its departure")

    def unreachable(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Report pairs that cannot connect, ``(a, b)``: a could not connect to b. The next round keeps only
        the largest set of its candidates with no such pair (`elastic.recovery.partition`); the others are
        not members of it (nor waited for). One store write; fails soft.

        Args:
            pairs: ``(a, b)`` participant ids, this participant's findings.
        """
        tokens = "".join(f"x{a}|{b}," for a, b in pairs if a != b)
        if tokens:
            self._write(tokens, "report the participants it cannot connect to")

    def finish(self) -> None:
        """The function returned in the current generation: the run is finished, every later join (and any
        join waiting in the next round) returns None. Fails soft."""
        try:
            self._store.set(FINISHED, str(self._generation))
            cast(Ops, self._store).append(log_key(self._generation + 1), "!,")
        except _STORE_ERRORS as exc:
            log.warning(
                "rendezvous: %s could not mark the run finished in the store at %s (%s)",
                self.participant,
                self.address or "?",
                exc,
            )

    def close(self) -> None:
        """Stop the heartbeat thread and drop its store connection (idempotent)."""
        self._closed = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=max(1.0, 4 * self.period))
            if not thread.is_alive():
                self._beat_store = None

    # ---------------------------------------------------------------------------------------- private

    def _write(self, event: str, what: str) -> None:
        """Append `event` to the next round's log (this participant's generation is over for it)."""
        if self._generation < 0:
            return
        try:
            cast(Ops, self._store).append(log_key(self._generation + 1), event)
        except _STORE_ERRORS as exc:
            log.warning(
                "rendezvous: %s could not %s to the store at %s (%s); the others will see its heartbeat stop",
                self.participant,
                what,
                self.address or "?",
                exc,
            )

    def _fresh(self, p: str, now: float, within: float) -> bool:
        """p's counter changed within `within` seconds (a participant never seen yet counts as fresh), and
        p's process has not exited (known at once for a participant of this process space)."""
        pid = self._pids.get(p)
        if pid is not None and not running(pid):
            return False
        seen = self._seen.get(p)
        return seen is None or now - seen.changed <= within

    def _locate(self, store: dist.Store, names: list[str]) -> None:
        """Learn, once per participant, whether it runs in this process space and with which pid: a
        participant on this host whose process has exited is dead at once, without waiting for its
        heartbeat to expire (a SIGKILLed worker). Elsewhere its heartbeat alone decides."""
        for p in names:
            if p in self._pids or not self._space or not store.check([where_key(p)]):
                continue
            space, _, pid = store.get(where_key(p)).decode().rpartition("|")
            self._pids[p] = int(pid) if space == self._space and pid.isdigit() else None

    def _observe(self, store: dist.Store, names: Iterable[str]) -> None:
        """Read the heartbeat counters of `names` and note when each last changed."""
        names = list(names)
        if not names:
            return
        self._locate(store, names)
        values = store.multi_get([hb_key(p) for p in names])
        now = time.monotonic()
        with self._lock:
            self._observed_at = now
            for p, raw in zip(names, values):
                counter = int(raw.decode() or 0)
                seen = self._seen.get(p)
                if seen is None:
                    self._seen[p] = _Seen(counter, now, confirmed=False)
                elif seen.counter != counter:
                    self._seen[p] = _Seen(counter, now, confirmed=True)

    def _proposer(self, view: _View) -> Propose:
        def propose(n: int, prev: tuple[str, ...], events: Log) -> tuple[str, ...] | None:
            if view.round != n or view.events != events:
                view.round, view.events, view.changed = n, events, time.monotonic()
            others = {p for p in (*prev, *events.joined) if p != self.participant}
            self._observe(self._store, others)
            now = time.monotonic()

            # A member that announced its regroup may be stalled in its abort: wait `grace` for it. So
            # does a round no previous member joined yet (a joiner while the generation trains, or every
            # member dead): it is never urgent, and a generation stalled in its start (imports, group
            # init, garbage collection hold the GIL) must not look dead to a newcomer.
            orphan = not any(q in prev for q in events.joined)

            def alive(p: str) -> bool:
                within = self.grace if p in events.announced or (orphan and p in prev) else self.expiry
                return p == self.participant or self._fresh(p, now, within)

            def ready(p: str) -> bool:
                seen = self._seen.get(p)
                return p == self.participant or (seen is not None and seen.confirmed and alive(p))

            view.prev = prev
            view.alive = tuple(p for p in dict.fromkeys((*prev, *events.joined)) if alive(p))
            return decide(
                prev,
                events,
                alive=alive,
                ready=ready,
                min_workers=self.first_workers if n == 0 else self.min_workers,
                max_workers=self.max_workers,
                quiet=now - view.changed >= self.last_call,
                fit=self.fit,
            )

        return propose

    def _join_timeout_error(self, j: Joiner, view: _View) -> ElasticError:
        limits = f"min_workers={self.min_workers}"
        if j.round == 0 and self.first_workers != self.min_workers:
            limits += f", first_workers={self.first_workers} for the first generation"
        if self.max_workers < 1 << 30:
            limits += f", max_workers={self.max_workers}"
        msg = (
            f"elastic: participant {self.participant!r}: no generation formed within "
            f"join_timeout={self.join_timeout:g} s: round {j.round} has joined {list(view.events.joined)}, "
            f"alive {list(view.alive)}, previous members {list(view.prev)} ({limits}); start more "
            f"workers, lower min_workers, or raise join_timeout"
        )
        return ElasticError(msg)

    def _retry(self, op: Callable[[], T]) -> T:
        """`op()`, retried while the store is unreachable, for at most `timeout`."""
        down_since: float | None = None
        while True:
            try:
                return op()
            except _STORE_ERRORS as exc:
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                if now - down_since >= self.timeout:
                    msg = (
                        f"elastic: the rendezvous store at {self.address or '?'} has been unreachable for "
                        f"{now - down_since:.1f} s (timeout={self.timeout:g} s): {exc}; restart it "
                        f"(`python -m elastic.store`) or check the address"
                    )
                    raise ElasticError(msg) from exc
                time.sleep(min(self.period, 0.05))

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        if self._beat_store is None:
            try:
                clone = self._base.clone()  # type: ignore[attr-defined]
                self._beat_store = dist.PrefixStore(f"elastic/{self.run_id}/", clone)
            except (*_STORE_ERRORS, AttributeError):
                self._beat_store = self._store
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._beat_loop, name=f"elastic-heartbeat-{self.participant}", daemon=True
        )
        self._thread.start()

    def _beat_loop(self) -> None:
        store = self._beat_store if self._beat_store is not None else self._store
        while not self._stop.wait(self.period):
            try:
                self._beat_once(store)
            except _STORE_ERRORS as exc:
                if self._store_down_since is None:
                    self._store_down_since = time.monotonic()
                    log.warning(
                        "rendezvous: %s lost the store at %s (%s); the generation goes on, the next "
                        "regroup fails after timeout=%g s if it does not come back",
                        self.participant,
                        self.address or "?",
                        exc,
                        self.timeout,
                    )
            else:
                self._store_down_since = None

    def _beat_once(self, store: dist.Store) -> None:
        if self._making_progress(time.monotonic()):
            store.add(hb_key(self.participant), 1)
        with self._lock:
            generation, members = self._generation, self._members
        if generation < 0:
            return
        self._observe(store, [p for p in members if p != self.participant])
        raw = read(cast(Ops, store), log_key(generation + 1))
        pending = pending_from(raw, members, self.max_workers, self.fit)
        with self._lock:
            if self._generation == generation:
                self._pending = pending
