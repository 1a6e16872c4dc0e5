"""The round protocol of `elastic.run`: who is in the next generation, decided once, over a TCPStore.

The protocol is written down, with its properties and their argument, in docs/rendezvous.md; a model of
it is docs/rendezvous.pml and tests/test_rendezvous.py drives `step` (the protocol's whole decision
logic, one store operation per call) through every interleaving of a few participants.

Keys, under ``elastic/<run_id>/`` in the store:

- ``hb/<p>``: participant p's heartbeat counter, incremented every `period` by a thread of p while p
  made progress within `timeout` (a hung process stops beating, a dead one too).
- ``r/<n>/ev``: the events of round n, appended: ``+p,`` (p joins round n), ``-p,`` (p leaves).
- ``r/<n>/dec``: the decision of round n, the members of generation n in rank order, written once by
  ``compare_set`` (the first proposal wins, every participant reads the same).
- ``next``: a hint, the lowest round that may be undecided (participants scan up from it).
- ``finished``: the generation whose function returned; later joiners get None.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Protocol, TypeVar, cast

import attrs
import torch.distributed as dist

from ._errors import ElasticError

__all__ = [
    "Joiner",
    "Membership",
    "Rendezvous",
    "decide",
    "parse_events",
    "pending_from",
    "start",
    "step",
]

log = logging.getLogger("elastic")

FINISHED = "finished"
NEXT = "next"


def ev_key(n: int) -> str:
    return f"r/{n}/ev"


def dec_key(n: int) -> str:
    return f"r/{n}/dec"


def hb_key(p: str) -> str:
    return f"hb/{p}"


class Ops(Protocol):
    """The store operations the protocol uses (a torch Store has them; tests use an in-memory one)."""

    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def set(self, key: str, value: str) -> None: ...
    def add(self, key: str, value: int) -> int: ...
    def append(self, key: str, value: str) -> None: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


@attrs.frozen
class Membership:
    """This participant's place in a generation, identical on every member but for `rank`."""

    generation: int
    rank: int
    size: int
    members: tuple[str, ...]
    prefix: str


def parse_events(raw: bytes) -> tuple[tuple[str, ...], frozenset[str]]:
    """(participants that joined, in order of first join; participants that left) of a round's events."""
    joined: dict[str, None] = {}
    left: set[str] = set()
    for token in raw.decode().split(","):
        if token.startswith("+"):
            joined.setdefault(token[1:], None)
        elif token.startswith("-"):
            left.add(token[1:])
    return tuple(p for p in joined if p not in left), frozenset(left)


def decide(
    prev: tuple[str, ...],
    joined: tuple[str, ...],
    left: frozenset[str],
    alive: Callable[[str], bool],
    *,
    min_workers: int,
    max_workers: int,
    quiet: bool,
) -> tuple[str, ...] | None:
    """The membership to propose for a round, or None to wait.

    `prev` are the members of the previous generation, `joined` and `left` the round's events so far,
    `alive(p)` this proposer's view of p's heartbeat, `quiet` whether the round's events have not changed
    for a last call. Members: the joined participants still alive, previous members first (in their
    previous rank order) then newcomers in join order, at most `max_workers`. The round closes as soon
    as every live previous member has joined (no wait for the dead); a round no previous member has
    joined (the first, or after every member died) closes after a quiet last call, so that workers
    starting together form one generation.
    """
    candidates = [p for p in joined if p not in left and alive(p)]
    ordered = [p for p in prev if p in candidates] + [p for p in candidates if p not in prev]
    if len(ordered) >= max_workers:
        return tuple(ordered[:max_workers])
    if len(ordered) < min_workers:
        return None
    if any(p not in left and p not in candidates and alive(p) for p in prev):
        return None
    if not any(p in prev for p in ordered) and not quiet:
        return None
    return tuple(ordered)


def pending_from(
    decided_next: bool, events: bytes | None, members: tuple[str, ...], max_workers: int
) -> bool:
    """Should generation `members` end at its next check, seen from the next round's state?

    Yes when the next round is decided (this generation is stale), when a member left or went on to the
    next round, or when a newcomer waits and the generation has room for it.
    """
    if decided_next:
        return True
    if events is None:
        return False
    joined, left = parse_events(events)
    if any(p in left for p in members) or any(p in members for p in joined):
        return True
    return bool(joined) and len(members) < max_workers


@attrs.frozen
class Joiner:
    """A participant's progress through `join`: the protocol as a state machine, one store op per step.

    phase: ``fin`` (is the run finished?), ``hint`` (read the lowest undecided round), ``scan`` (skip
    decided rounds), ``append`` (announce itself in the round), ``prev`` (read the previous generation),
    ``wait`` (is the round decided?), ``events`` (read the round's events and maybe propose), ``cas``
    (the one atomic decision), ``read`` (read the decision), ``sethint`` (the winner advances ``next``),
    ``done``.
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


def _members(raw: bytes) -> tuple[str, ...]:
    text = raw.decode()
    return tuple(text.split(",")) if text else ()


def _after_decision(j: Joiner, members: tuple[str, ...]) -> Joiner:
    if j.me in members:
        return attrs.evolve(j, phase="done", decision=members)
    # A straggler: this round formed without it; it is a newcomer of the next one.
    return attrs.evolve(j, phase="fin", round=j.round + 1, prev=(), proposal=(), decision=())


Propose = Callable[[int, tuple[str, ...], tuple[str, ...], frozenset[str]], "tuple[str, ...] | None"]


def step(j: Joiner, store: Ops, propose: Propose) -> Joiner:
    """One store operation of participant `j`'s join; `propose(round, prev, joined, left)` judges.

    The result's phase is ``done`` with `decision` (the generation `round`'s members, `me` among them)
    or `finished` set; otherwise call again (after a short sleep when the phase is ``wait``).
    """
    if j.phase == "fin":
        if store.check([FINISHED]):
            return attrs.evolve(j, phase="done", finished=True)
        return attrs.evolve(j, phase="hint")
    if j.phase == "hint":
        return attrs.evolve(j, phase="scan", round=max(j.round, store.add(NEXT, 0)))
    if j.phase == "scan":
        if store.check([dec_key(j.round)]):
            return attrs.evolve(j, round=j.round + 1)
        return attrs.evolve(j, phase="append")
    if j.phase == "append":
        store.append(ev_key(j.round), f"+{j.me},")
        return attrs.evolve(j, phase="prev" if j.round > 0 else "wait")
    if j.phase == "prev":
        return attrs.evolve(j, phase="wait", prev=_members(store.get(dec_key(j.round - 1))))
    if j.phase == "wait":
        if store.check([dec_key(j.round)]):
            return attrs.evolve(j, phase="read")
        return attrs.evolve(j, phase="events")
    if j.phase == "read":
        return _after_decision(j, _members(store.get(dec_key(j.round))))
    if j.phase == "events":
        joined, left = parse_events(store.get(ev_key(j.round)))
        proposal = propose(j.round, j.prev, joined, left)
        if proposal is None:
            return attrs.evolve(j, phase="wait")
        return attrs.evolve(j, phase="cas", proposal=proposal)
    if j.phase == "cas":
        winner = _members(store.compare_set(dec_key(j.round), "", ",".join(j.proposal)))
        if winner == j.proposal:
            return attrs.evolve(j, phase="sethint", decision=winner)
        return _after_decision(j, winner)
    if j.phase == "sethint":
        store.set(NEXT, str(j.round + 1))
        return _after_decision(j, j.decision)
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
    events: tuple[tuple[str, ...], frozenset[str]] = ((), frozenset())
    changed: float = 0.0
    prev: tuple[str, ...] = ()
    alive: tuple[str, ...] = ()


class Rendezvous:
    """One participant of the rounds of run `run_id` over `store` (see docs/rendezvous.md).

    `timeout`: a participant that made no `progress()` for that long stops heartbeating (counts as hung),
    and the store unreachable for that long is an error. Heartbeats every `period` (default: `timeout`/50
    within 0.05..0.1 s); a participant whose counter did not change for `expiry` (default 6 periods) is
    dead to the others. `last_call` (default 1 s): how long a round that no previous member joined waits
    for more joiners once `min_workers` are there.
    """

    def __init__(
        self,
        store: dist.Store,
        run_id: str,
        participant: str,
        *,
        min_workers: int = 1,
        max_workers: int | None = None,
        join_timeout: timedelta,
        timeout: timedelta,
        address: str = "",
        period: timedelta | None = None,
        expiry: timedelta | None = None,
        last_call: timedelta | None = None,
    ) -> None:
        if not participant or any(c in participant for c in ",/") or participant[0] in "+-":
            msg = (
                f"elastic: participant id {participant!r} must be non-empty, contain no ',' or '/' and not "
                f"start with '+' or '-'; use for instance 'host-pid'"
            )
            raise ElasticError(msg)
        if min_workers < 1 or (max_workers is not None and max_workers < min_workers):
            msg = (
                f"elastic: min_workers={min_workers}, max_workers={max_workers}: need 1 <= min_workers <= "
                f"max_workers"
            )
            raise ElasticError(msg)
        self.run_id = run_id
        self.participant = participant
        self.min_workers = min_workers
        self.max_workers = max_workers if max_workers is not None else 1 << 30
        self.join_timeout = _seconds(join_timeout)
        self.timeout = _seconds(timeout)
        self.address = address
        self.period = _seconds(period) if period is not None else min(0.1, max(0.05, self.timeout / 50))
        self.expiry = _seconds(expiry) if expiry is not None else 6 * self.period
        self.last_call = _seconds(last_call) if last_call is not None else 1.0
        self._base = store
        self._store = dist.PrefixStore(f"elastic/{run_id}/", store)
        self._beat_store: dist.Store | None = None
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, float]] = {}  # participant -> (counter, when it last changed)
        self._last_progress = time.monotonic()
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

    def join(self) -> Membership | None:
        """Block until this participant is a member of a new generation and return it; None when the run
        is finished. ElasticError after `join_timeout` without a generation, or when the store is
        unreachable for `timeout`."""
        if self._left or self._closed:
            state = "left" if self._left else "closed"
            msg = (
                f"elastic: participant {self.participant!r} has {state} the rendezvous and cannot join again"
            )
            raise ElasticError(msg)
        began = time.monotonic()
        deadline = began + self.join_timeout
        self.progress()
        self._pending = False
        self._retry(lambda: self._store.add(hb_key(self.participant), 1))
        self._start_thread()
        j = start(self.participant, self._generation)
        joined_at = -1
        view = _View()
        propose = self._proposer(view)
        while True:
            self.progress()
            j = self._retry(functools.partial(step, j, cast(Ops, self._store), propose))
            if j.phase == "done":
                break
            if j.phase == "append":
                joined_at = j.round
            if j.phase == "wait":
                if time.monotonic() > deadline:
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

    def pending(self) -> bool:
        """Someone waits to join, a member left, or a newer generation formed: end this generation at the
        next check. Reads no store: the heartbeat thread refreshes it every `period`."""
        return self._pending

    def alive(self) -> set[str]:
        """The members of the current generation whose heartbeat is fresh (one store read; this
        participant counts while it makes progress)."""
        members = self._members
        others = [p for p in members if p != self.participant]
        with contextlib.suppress(*_STORE_ERRORS):
            self._observe(self._store, others)
        now = time.monotonic()
        fresh = {p for p in others if self._fresh(p, now)}
        if self.participant in members and now - self._last_progress < self.timeout:
            fresh.add(self.participant)
        return fresh

    def leave(self) -> None:
        """A planned departure: the others end the generation at their next check and go on without it."""
        self._left = True
        if self._generation < 0:
            return
        try:
            cast(Ops, self._store).append(ev_key(self._generation + 1), f"-{self.participant},")
        except _STORE_ERRORS as exc:
            log.warning(
                "rendezvous: %s could not announce its departure to the store at %s (%s); the others "
                "will see its heartbeat stop",
                self.participant,
                self.address or "?",
                exc,
            )

    def finish(self) -> None:
        """The function returned in the current generation: the run is finished for every later joiner."""
        try:
            self._store.set(FINISHED, str(self._generation))
        except _STORE_ERRORS as exc:
            log.warning(
                "rendezvous: %s could not mark the run finished in the store at %s (%s)",
                self.participant,
                self.address or "?",
                exc,
            )

    def close(self) -> None:
        """Stop the heartbeat thread (idempotent)."""
        self._closed = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=max(1.0, 4 * self.period))

    # ---------------------------------------------------------------------------------------- private

    def _fresh(self, p: str, now: float) -> bool:
        seen = self._seen.get(p)
        return seen is None or now - seen[1] <= self.expiry

    def _observe(self, store: dist.Store, names: Iterable[str]) -> None:
        """Read the heartbeat counters of `names` and note when each last changed."""
        names = list(names)
        if not names:
            return
        values = store.multi_get([hb_key(p) for p in names])
        now = time.monotonic()
        with self._lock:
            for p, raw in zip(names, values):
                counter = int(raw.decode() or 0)
                seen = self._seen.get(p)
                if seen is None or seen[0] != counter:
                    self._seen[p] = (counter, now)

    def _proposer(self, view: _View) -> Propose:
        def propose(
            n: int, prev: tuple[str, ...], joined: tuple[str, ...], left: frozenset[str]
        ) -> tuple[str, ...] | None:
            if view.round != n or view.events != (joined, left):
                view.round, view.events, view.changed = n, (joined, left), time.monotonic()
            self._observe(self._store, {p for p in (*prev, *joined) if p != self.participant})
            now = time.monotonic()

            def alive(p: str) -> bool:
                return p == self.participant or self._fresh(p, now)

            view.prev = prev
            view.alive = tuple(p for p in dict.fromkeys((*prev, *joined)) if alive(p))
            return decide(
                prev,
                joined,
                left,
                alive,
                min_workers=self.min_workers,
                max_workers=self.max_workers,
                quiet=now - view.changed >= self.last_call,
            )

        return propose

    def _join_timeout_error(self, j: Joiner, view: _View) -> ElasticError:
        limits = f"min_workers={self.min_workers}"
        if self.max_workers < 1 << 30:
            limits += f", max_workers={self.max_workers}"
        msg = (
            f"elastic: participant {self.participant!r}: no generation formed within "
            f"join_timeout={self.join_timeout:g} s: round {j.round} has joined {list(view.events[0])}, "
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
                self._beat_store = dist.PrefixStore(f"elastic/{self.run_id}/", self._base.clone())  # type: ignore[attr-defined]
            except _STORE_ERRORS:
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
        if time.monotonic() - self._last_progress < self.timeout:
            store.add(hb_key(self.participant), 1)
        with self._lock:
            generation, members = self._generation, self._members
        if generation < 0:
            return
        self._observe(store, [p for p in members if p != self.participant])
        decided = store.check([dec_key(generation + 1)])
        events = store.get(ev_key(generation + 1)) if store.check([ev_key(generation + 1)]) else None
        pending = pending_from(decided, events, members, self.max_workers)
        with self._lock:
            if self._generation == generation:
                self._pending = pending
