"""The round protocol of `elastic.run`: who is in the next generation, decided once, over a TCPStore.

The protocol is written down, with its properties and their argument, in docs/rendezvous.md; a model of
it is docs/rendezvous.pml, and tests/recovery/test_rendezvous.py drives `step` (the protocol's whole decision
logic, one store operation per call) through every interleaving of a few participants.

Keys, under ``elastic/<run_id>/`` in the store:

- ``hb/<p>``: participant p's heartbeat counter, incremented every `period` by a thread of p while p
  made progress within `timeout` (a hung process stops beating, a dead one too).
- ``r/<n>/n`` and ``r/<n>/<i>``: the events of round n, numbered from 1 (``add`` takes a number, ``set``
  writes the event): ``+p`` (p joins round n), ``~p`` (p, a member of generation n-1, announced it is on
  its way), ``-p`` (p leaves for good), ``?p`` (p's heartbeat stopped, as its observer judged). Read
  incrementally: a reader keeps how far it read.
- ``lead/<n>``: the one participant that judges round n (the first joiner, by ``compare_set``; another
  joiner takes over when its heartbeat stops). Only it reads the events and the heartbeats.
- ``d/<n>``: THE decision of round n, written once by ``compare_set``: ``!`` (the run finished) or
  ``<leader>;<removed>;<added>;<digest>``, the members as a change of generation n-1's (a few bytes for
  every member of n-1); ``m/<n>/<leader>``, written before it, holds the whole list in rank order.
- ``s/<g>``: the summary that generation g's monitor (its rank 0) writes every period: its own counter,
  whether g must end (`pending`), and the members whose heartbeat stopped, with their age. The other
  members read only this key: liveness costs O(N) store reads per period in all.
- ``next``: a hint, a round such that every lower round is decided (participants scan up from it);
  only ever raised.
- ``epoch``: a token naming this store's life: a client that finds another one after reconnecting knows
  the store restarted empty, and re-seeds what its generation needs.
- ``finished``: set when a generation's function returned; later joiners get None.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Protocol, TypeVar

import attrs
import torch.distributed as dist

from elastic._util.errors import ElasticError
from elastic._util.procs import running
from elastic.recovery.partition import largest_reachable
from elastic.recovery.store import client

__all__ = [
    "Joiner",
    "Log",
    "Membership",
    "Rendezvous",
    "decide",
    "parse_log",
    "pending_from",
    "read_round",
    "reseed",
    "start",
    "step",
]

log = logging.getLogger("elastic")

FINISHED = "finished"
NEXT = "next"
EPOCH = "epoch"
_STORE_ERRORS = (RuntimeError, OSError, ValueError)
#: a value never stored: `peek`'s expected value, so that its compare_set neither matches nor creates
ABSENT = "\x00"


def hb_key(p: str) -> str:
    return f"hb/{p}"


def where_key(p: str) -> str:
    return f"where/{p}"


def count_key(n: int) -> str:
    return f"r/{n}/n"


def event_key(n: int, i: int) -> str:
    return f"r/{n}/{i}"


def lead_key(n: int) -> str:
    return f"lead/{n}"


def decision_key(n: int) -> str:
    return f"d/{n}"


def members_key(n: int, leader: str) -> str:
    return f"m/{n}/{leader}"


def tick_count_key(n: int) -> str:
    return f"t/{n}/n"


def tick_key(n: int, k: int) -> str:
    return f"t/{n}/{k}"


#: every how many heartbeat periods a member other than the monitor reads the monitor's summary (the
#: monitor reads every member's counter every period): about 1.5 N keys read per period in all
FOLLOW_EVERY = 2
#: how long one attempt to reach a store that went away may take (seconds)
RECONNECT = 0.25
#: how often a round's leader rings while it judges (the others wait for its ticks with `store.wait`)
TICK = 0.5
#: A training generation's member is judged gone when its counter stood still for its own limit: `expiry`
#: plus JITTER times the longest recent excess of a gap between two changes of its counter over the
#: observer's reading interval (a lossy network's TCP retransmissions hold a beat 0.2 s for a lost
#: segment, 0.6 s for two in a row, 1.4 s for three), at most `stale_cap`. On a clean network the excess
#: is about 0.
JITTER = 2.0
#: Seconds in which an excess's weight in that limit halves (with 3 % loss, two retransmissions in a row
#: hold a member's beat about once a minute).
JITTER_HALF_LIFE = 60.0


def summary_key(g: int) -> str:
    return f"s/{g}"


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
    """The store operations the protocol uses (`_StoreOps` over a torch Store; tests use an in-memory
    one). `wait_for(key, seconds)`: block until `key` exists (True) or `seconds` passed (False)."""

    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def set(self, key: str, value: str) -> None: ...
    def add(self, key: str, value: int) -> int: ...
    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...
    def wait_for(self, key: str, seconds: float) -> bool: ...
    def delete_key(self, key: str) -> bool: ...


def peek(store: Ops, key: str) -> bytes | None:
    """The value of `key`, None when missing: one operation that never blocks and never creates it."""
    raw = store.compare_set(key, ABSENT, ABSENT)
    return None if raw == ABSENT.encode() else raw


def raise_to(store: Ops, key: str, value: int) -> int:
    """Raise the integer at `key` to at least `value` (never lower it); the value it holds after."""
    current = peek(store, key)
    while current is None or int(current.decode() or 0) < value:
        expected = "" if current is None else current.decode()
        current = store.compare_set(key, expected, str(value))
    return int(current.decode() or 0)


def add_event(store: Ops, n: int, token: str) -> None:
    """Append event `token` to round n's events (two operations: a number, then the event)."""
    store.set(event_key(n, store.add(count_key(n), 1)), token)


def ring(store: Ops, n: int) -> None:
    """A tick of round n: every participant waiting for the round's decision wakes and looks."""
    k = store.add(tick_count_key(n), 1)
    store.set(tick_key(n, k), "")
    if k > 2:  # the waiters wait for the newest ones only
        with contextlib.suppress(*_STORE_ERRORS):
            store.delete_key(tick_key(n, k - 2))


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
    """A round's events: who joined (in order of first join), who announced, left or was judged dead by
    its observer (`suspected`), the decision (None: undecided), whether the run finished, and the pairs
    reported unable to connect."""

    joined: tuple[str, ...] = ()
    announced: frozenset[str] = frozenset()
    left: frozenset[str] = frozenset()
    decision: tuple[str, ...] | None = None
    finished: bool = False
    suspected: frozenset[str] = frozenset()
    unreachable: frozenset[frozenset[str]] = frozenset()


def parse_events(tokens: Iterable[str]) -> Log:
    """The `Log` of a round's event tokens (``+p`` ``~p`` ``-p`` ``?p``, ``xa|b``: a cannot connect to b;
    ``=a|b`` a decision and ``!`` the end of the run, as `read_round` adds them)."""
    joined: dict[str, None] = {}
    announced: set[str] = set()
    left: set[str] = set()
    suspected: set[str] = set()
    unreachable: set[frozenset[str]] = set()
    decision: tuple[str, ...] | None = None
    finished = False
    for token in tokens:
        kind, name = token[:1], token[1:]
        if kind == "+":
            joined.setdefault(name, None)
        elif kind == "~":
            announced.add(name)
        elif kind == "-":
            left.add(name)
        elif kind == "?":
            suspected.add(name)
        elif kind == "x" and len(pair := frozenset(name.split("|"))) == 2:
            unreachable.add(pair)  # xa|b: a cannot connect to b
        elif kind == "=" and decision is None:
            decision = tuple(name.split("|"))
        elif kind == "!":
            finished = True
    return Log(
        joined=tuple(p for p in joined if p not in left),
        announced=frozenset(announced),
        left=frozenset(left),
        decision=decision,
        finished=finished,
        suspected=frozenset(suspected),
        unreachable=frozenset(unreachable),
    )


def parse_log(raw: bytes) -> Log:
    """The `Log` of comma-separated event tokens (``+c,+a,~b,=a|b,``)."""
    return parse_events(t for t in raw.decode().split(",") if t)


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
    # sets for the membership tests: linear in the participants, not quadratic (2,048 of them)
    candidates = [p for p in events.joined if ready(p)]
    # pairs that cannot connect: only the largest set with none goes on, and the others (joined, or live
    # previous members that wait outside) are not waited for (docs/rendezvous.md, "Pairs that cannot connect")
    gone, joined = set(events.left), set(candidates)
    expected = candidates + [p for p in prev if p not in gone and p not in joined and alive(p)]
    cut = set(expected) - set(largest_reachable(expected, events.unreachable, prefer=prev))
    candidates = [p for p in candidates if p not in cut]
    chosen, before = set(candidates), set(prev)
    ordered = [p for p in prev if p in chosen] + [p for p in candidates if p not in before]
    missing = [p for p in prev if p not in gone and p not in chosen and p not in cut and alive(p)]
    if missing and sum(p in before for p in ordered) < max_workers:
        return None
    unsure = [p for p in events.joined if not ready(p) and alive(p)]
    if unsure and len(ordered) < max_workers:
        return None
    if len(ordered) >= max_workers:
        return _ranks(_fitted(ordered[:max_workers], fit), prev, fit)
    if len(ordered) < min_workers:
        return None
    if not any(p in before for p in ordered) and not quiet:
        return None
    return _ranks(_fitted(ordered, fit), prev, fit)


def _ranks(chosen: list[str], prev: tuple[str, ...], fit: Callable[[int], int] | None) -> tuple[str, ...]:
    """`chosen` in rank order: `ranked`, except that with a mesh (`fit`) the previous members keep their
    ranks where they still exist and the others fill the free ranks in `ranked` order, so that when the
    mesh stays a survivor keeps its coordinate (and its pieces: the state is kept, not resharded)."""
    if fit is None or not prev:
        return ranked(chosen)
    places: list[str | None] = [None] * len(chosen)
    where = {p: i for i, p in enumerate(prev)}
    for p in chosen:
        if p in where and where[p] < len(chosen):
            places[where[p]] = p
    placed = set(places)
    rest = iter(ranked([p for p in chosen if p not in placed]))
    return tuple(p if p is not None else next(rest) for p in places)


def _fitted(ordered: list[str], fit: Callable[[int], int] | None) -> list[str]:
    """The first `fit(len(ordered))` of `ordered` (previous members come first there)."""
    if fit is None:
        return ordered
    return ordered[: max(1, min(len(ordered), fit(len(ordered))))]


@functools.lru_cache(maxsize=1 << 16)
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
    events: Log | bytes, members: tuple[str, ...], max_workers: int, fit: Callable[[int], int] | None = None
) -> bool:
    """Should generation `members` end at its next check, seen from the next round's `events` (a `Log`,
    or its comma-separated tokens)?

    Yes when the next round is decided (this generation is stale) or the run finished, when a member
    left, announced or went on to the next round, or when a newcomer waits and the generation has room.
    (A member whose heartbeat stopped ends it too while it stays stopped: the monitor adds that.)
    """
    ev = parse_log(events) if isinstance(events, bytes) else events
    if ev.decision is not None or ev.finished:
        return True
    joined = set(ev.joined)
    if any(p in ev.left or p in ev.announced or p in joined for p in members):
        return True
    if not ev.joined or len(members) >= max_workers:
        return False
    if fit is None:
        return True
    # a sharded state's mesh may have no use for the newcomers (spares): the generation goes on
    return fit(min(max_workers, len(members) + len(ev.joined))) > len(members)


def digest(members: tuple[str, ...]) -> str:
    return f"{zlib.crc32('|'.join(members).encode()):08x}"


def encode_decision(leader: str, members: tuple[str, ...], prev: tuple[str, ...]) -> str:
    """``d/<n>``'s value: generation n as a change of generation n-1 (`prev`) by `leader`."""
    chosen, before = set(members), set(prev)
    removed = "|".join(p for p in prev if p not in chosen)
    added = "|".join(p for p in members if p not in before)
    return f"{leader};{removed};{added};{digest(members)}"


def decode_decision(
    raw: bytes, prev: tuple[str, ...] | None, fit: Callable[[int], int] | None
) -> tuple[str, tuple[str, ...] | None]:
    """(leader, members) of a ``d/<n>`` value; members None when they cannot be rebuilt from `prev`
    (generation n-1's members, None: unknown) and must be read from ``m/<n>/<leader>``."""
    leader, removed, added, check = raw.decode().split(";")
    if prev is None or removed == "*":
        return leader, None
    gone = set(removed.split("|")) if removed else set()
    chosen = [p for p in prev if p not in gone] + (added.split("|") if added else [])
    # only members gone: the rest keep their rank order (`ranked` of a ranked list without some of it is
    # that list; the digest checks it), with no sort of N ids on each of N members
    members = tuple(chosen) if fit is None and not added else _ranks(chosen, prev, fit)
    return leader, (members if digest(members) == check else None)


@attrs.frozen
class Joiner:
    """A participant's progress through `join`: the protocol as a state machine, one store op per step.

    phase: ``fin`` (is the run finished?), ``hint`` (read ``next``), ``scan`` (skip decided rounds; both
    skipped by a member of the previous generation, which joins the round after it at once),
    ``slot``/``put`` (number and write ``+me``), ``prev``/``prevall`` (generation round-1's members, when
    not a member of it), ``lead`` (become the round's leader, or learn who is), then for the leader
    ``poll`` (decided? the decision itself, read at once), ``current?`` (has ``next`` passed this round:
    a restarted store re-seeded a later generation; then ``over?``: decided just now, or obsolete),
    ``count`` (how many events), ``check`` (are the first `batch` unread ones all written? a binary
    search while one is a hole, numbered but not written yet: the first new hole ends the poll's
    reading, the same hole at the next poll is skipped and read again later), ``fetch`` (those, in one
    ``multi_get``; judge when none is left), ``propose`` (write the whole list),
    ``guard`` (a round with no previous generation: does ``next`` still allow it?), ``commit`` (the
    decision's compare_set); for the others ``wait`` (the leader's ticks), ``wake`` (as ``poll``),
    ``sleep`` (for the next tick, bounded), ``obsolete?`` (when no tick came: as ``current?``, then
    judge the leader) and ``takeover``; then ``all`` (the whole list, when the decision's change of the
    previous generation does not rebuild it), ``hinted`` (the leader raises ``next``), ``done``.
    """

    me: str
    phase: str
    round: int
    generation: int = -1  # the last generation this participant was a member of
    members: tuple[str, ...] = ()  # ... and its members
    prev: tuple[str, ...] | None = None  # generation round-1's members (None: not known yet)
    orphan: bool = False  # generation round-1 is not in the store (a restarted store)
    slot: int = 0
    leader: str = ""
    tick: int = 0  # the last tick of the leader this participant saw
    read: int = 0  # events read: 1..read, but for `holes`
    holes: tuple[int, ...] = ()  # events numbered but not written when read (their writer may be slow)
    events: tuple[str, ...] = ()
    unread: tuple[int, ...] = ()  # the events the ``check``/``fetch`` phases read (after ``count``)
    fresh: int = 0  # the first of them not numbered at the previous poll (those before it: `holes`)
    blocked: int = 0  # the hole the previous poll stopped at (skipped, as a hole, if it still is one)
    batch: int = 0  # how many of `unread`, from the first, the next ``check`` asks for
    good: int = 0  # ... how many the checks found written (a prefix of `unread`)
    bad: int = 0  # ... the shortest prefix found with a hole (0: none found)
    proposal: tuple[str, ...] = ()
    decision: tuple[str, ...] = ()
    finished: bool = False


def start(me: str, generation: int, members: tuple[str, ...] = ()) -> Joiner:
    """A join by `me`, last a member of `generation` (-1: never) with `members`."""
    return Joiner(me=me, phase="fin", round=generation + 1, generation=generation, members=members)


Propose = Callable[[int, tuple[str, ...], Log, bool], "tuple[str, ...] | None"]
Gone = Callable[[str], bool]


def _restart(j: Joiner, round: int) -> Joiner:
    """`j` joins again from round `round` on (a straggler, or a round that lost its previous one)."""
    return Joiner(me=j.me, phase="fin", round=round, generation=j.generation, members=j.members)


def _decided(j: Joiner, members: tuple[str, ...]) -> Joiner:
    if j.me not in members:
        # A straggler: this round formed without it; it is a newcomer of the next one.
        return _restart(j, j.round + 1)
    if j.leader == j.me:
        return attrs.evolve(j, phase="hinted", decision=members, proposal=())
    return attrs.evolve(j, phase="done", decision=members, proposal=())


def _judge(j: Joiner, propose: Propose) -> Joiner:
    """The leader judges what it read (no store operation): propose, or poll again."""
    prev = j.prev or ()
    proposal = propose(j.round, prev, parse_events(j.events), j.orphan)
    if proposal is None:
        return attrs.evolve(j, phase="poll")
    return attrs.evolve(j, phase="propose", proposal=proposal)


def step(
    j: Joiner,
    store: Ops,
    propose: Propose,
    *,
    gone: Gone | None = None,
    seen: Callable[[str], None] | None = None,
    fit: Callable[[int], int] | None = None,
    wait: float = 1.5,
) -> Joiner:
    """One store operation of participant `j`'s join.

    `propose(round, prev, log, orphan)` judges for the leader; `seen(leader)`: note the leader's heartbeat
    (at every wake once the leader has rung); `gone(leader)`: is the leader dead (judged when a wait for
    its next tick timed out); `fit`: the mesh (ranks); `wait`: how long one wait for a tick blocks (the
    leader rings every `TICK` seconds while it judges, and once when it decided). The result's phase is
    ``done`` with `decision` (generation `round`'s members, `me` among them) or `finished` set; otherwise
    call again (after a short sleep when the phase is ``poll``).
    """
    n = j.round
    if j.phase == "fin":
        if store.check([FINISHED]):
            return attrs.evolve(j, phase="done", finished=True)
        # a member of the previous generation joins the round after it at once: no `next` to read, no
        # decision to look for (it is rarely behind: then its event lands in a decided round, which it
        # learns from the decision it reads, and it joins the next round as a straggler does), two
        # operations less for each of a regroup's herd
        return attrs.evolve(j, phase="slot" if j.generation == n - 1 and n > 0 else "hint")
    if j.phase == "hint":
        return attrs.evolve(j, phase="scan", round=max(n, store.add(NEXT, 0)))
    if j.phase == "scan":
        if store.check([decision_key(n)]):
            return attrs.evolve(j, round=n + 1)
        return attrs.evolve(j, phase="slot")
    if j.phase == "slot":
        return attrs.evolve(j, phase="put", slot=store.add(count_key(n), 1))
    if j.phase == "put":
        store.set(event_key(n, j.slot), f"+{j.me}")
        if n == 0:
            return attrs.evolve(j, phase="lead", prev=(), orphan=True)
        if j.generation == n - 1:
            return attrs.evolve(j, phase="lead", prev=j.members)
        return attrs.evolve(j, phase="prev")
    if j.phase == "prev":
        raw = peek(store, decision_key(n - 1))
        if raw is None:  # the store restarted: nothing of round n-1 survived
            return attrs.evolve(j, phase="lead", prev=(), orphan=True)
        if raw == b"!":
            return attrs.evolve(j, phase="done", finished=True)
        leader, _ = decode_decision(raw, None, fit)
        return attrs.evolve(j, phase="prevall", leader=leader)
    if j.phase == "prevall":
        raw = peek(store, members_key(n - 1, j.leader))
        prev = tuple(raw.decode().split("|")) if raw else ()
        return attrs.evolve(j, phase="lead", prev=prev, orphan=raw is None, leader="")
    if j.phase == "lead":
        leader = store.compare_set(lead_key(n), "", j.me).decode()
        return attrs.evolve(j, phase="poll" if leader == j.me else "wait", leader=leader)
    if j.phase == "wait":  # the ticks first, then the decision: a decision after the check rings
        tick = store.add(tick_count_key(n), 0)
        # no tick yet: no decision has rung either (the leader rings after its commit), so the next tick
        # comes after any decision and the decision need not be read now (one operation less each for a
        # regroup's herd, whose leader decides before its first tick)
        return attrs.evolve(j, phase="wake" if tick else "sleep", tick=tick)
    if j.phase == "wake":  # decided? (the decision itself, read at once)
        raw = peek(store, decision_key(n))
        if raw is not None:
            return _read_decision(j, raw, fit)
        if seen is not None and j.tick:
            # the leader rang: it judges, alive; its heartbeat now is the baseline that `gone` compares
            # with when the ticks stop. Before any tick (a regroup's whole herd: its leader decides before
            # its first tick) no baseline is read: one operation less each; a leader that dies before
            # ringing is then judged one `wait` later (the first `gone` takes the baseline)
            seen(j.leader)
        return attrs.evolve(j, phase="sleep")
    if j.phase == "sleep":
        if store.wait_for(tick_key(n, j.tick + 1), wait):
            return attrs.evolve(j, phase="wake", tick=j.tick + 1)
        # no tick: the leader is gone, or no longer judges this round (`next` passed it: a restarted
        # store re-seeded a later generation, or its guard sent it on)
        return attrs.evolve(j, phase="obsolete?")
    if j.phase == "obsolete?":  # a restarted store re-seeded a later generation: this round is over
        if store.add(NEXT, 0) > n:
            return attrs.evolve(j, phase="over?")
        if gone is not None and gone(j.leader):
            return attrs.evolve(j, phase="takeover")
        return attrs.evolve(j, phase="wake")
    if j.phase == "takeover":
        leader = store.compare_set(lead_key(n), j.leader, j.me).decode()
        return attrs.evolve(j, phase="poll" if leader == j.me else "wait", leader=leader)
    if j.phase == "poll":
        raw = peek(store, decision_key(n))
        if raw is not None:
            return _read_decision(j, raw, fit)
        return attrs.evolve(j, phase="current?")
    if j.phase == "current?":  # a restarted store re-seeded a later generation: this round is over
        if store.add(NEXT, 0) > n:
            return attrs.evolve(j, phase="over?")
        return attrs.evolve(j, phase="count")
    if j.phase == "over?":  # `next` passed this round: decided just now (next is raised after), or obsolete
        raw = peek(store, decision_key(n))
        if raw is not None:
            return _read_decision(j, raw, fit)
        return _restart(j, n + 1)
    if j.phase == "count":
        count = store.add(count_key(n), 0)
        unread = (*j.holes, *range(j.read + 1, count + 1))
        if not unread:
            return _judge(j, propose)
        read = max(j.read, count)
        return attrs.evolve(
            j, phase="check", unread=unread, batch=len(unread), holes=(), fresh=j.read + 1, read=read
        )
    if j.phase == "check":  # are the first `batch` unread events all written? One operation for them all
        if store.check([event_key(n, i) for i in j.unread[: j.batch]]):
            good, bad = j.batch, j.bad
        else:
            good, bad = j.good, j.batch
        if bad and bad - good > 1:  # a hole among them: binary search for the written prefix (log N)
            return attrs.evolve(j, batch=(good + bad) // 2, good=good, bad=bad)
        # the first `good` are written; when `bad`, the one after them is a hole
        j = attrs.evolve(j, good=good, bad=bad)
        return attrs.evolve(j, phase="fetch") if good else _hole(j, propose)
    if j.phase == "fetch":  # the `good` events the check found written, in one operation
        values = store.multi_get([event_key(n, i) for i in j.unread[: j.good]])
        j = attrs.evolve(j, events=(*j.events, *(v.decode() for v in values)), unread=j.unread[j.good :])
        return _hole(j, propose) if j.bad else _unread(j, propose)
    if j.phase == "propose":
        store.set(members_key(n, j.me), "|".join(j.proposal))
        return attrs.evolve(j, phase="guard" if j.orphan else "commit")
    if j.phase == "guard":
        if store.add(NEXT, 0) > n:  # members re-seeded a later generation: this round is obsolete
            return _restart(j, n + 1)
        return attrs.evolve(j, phase="commit")
    if j.phase == "commit":
        token = encode_decision(j.me, j.proposal, j.prev or ())
        raw = store.compare_set(decision_key(n), "", token)
        if raw.decode() == token:
            return _decided(j, j.proposal)
        return _read_decision(j, raw, fit)
    if j.phase == "all":
        raw = peek(store, members_key(n, j.leader))
        if raw is None:  # the leader's list is gone (the store restarted): join again
            return _restart(j, n)
        return _decided(j, tuple(raw.decode().split("|")))
    if j.phase == "hinted":
        raise_to(store, NEXT, n + 1)
        return attrs.evolve(j, phase="ring")
    if j.phase == "ring":
        ring(store, n)
        return attrs.evolve(j, phase="done")
    msg = f"elastic: rendezvous step in phase {j.phase!r}, which has no next step (a bug in elastic)"
    raise ValueError(msg)


def _unread(j: Joiner, propose: Propose) -> Joiner:
    """Check the unread events left, or judge when none is."""
    if j.unread:
        return attrs.evolve(j, phase="check", batch=len(j.unread), good=0, bad=0)
    return _judge(attrs.evolve(j, batch=0, good=0, bad=0), propose)


def _hole(j: Joiner, propose: Propose) -> Joiner:
    """The first unread event is numbered but not written (its writer is between its two operations)."""
    i, rest = j.unread[0], j.unread[1:]
    if i < j.fresh or i == j.blocked:  # a hole since the last poll: skip it, read it again later
        return _unread(attrs.evolve(j, holes=(*j.holes, i), unread=rest), propose)
    # the first hole among the new events: judge what came before it, and go on from it at the next poll
    # (its writer has likely written it by then; the events after it are read then too)
    return _judge(attrs.evolve(j, read=i - 1, blocked=i, unread=(), batch=0, good=0, bad=0), propose)


def _read_decision(j: Joiner, raw: bytes, fit: Callable[[int], int] | None) -> Joiner:
    if raw == b"!":
        return attrs.evolve(j, phase="done", finished=True)
    known = j.prev if j.prev is not None and not j.orphan else None
    leader, members = decode_decision(raw, known, fit)
    if members is None:
        return attrs.evolve(j, phase="all", leader=leader)
    return _decided(attrs.evolve(j, leader=leader), members)


def reseed(
    ops: Ops, me: str, g: int, members: tuple[str, ...], evidence: str = "", k: int = 0
) -> tuple[int | None, bool]:
    """Operation `k` of `me`'s re-seed of a store restarted empty, as a member of generation `g` with
    `members`, that reported `evidence` (``xa|b,`` tokens) to round g+1: its list ``m/<g>/<me>`` (k=0);
    the decision ``d/<g>`` unless one is there (1: stale when another list got there first); ``next``
    raised to g (2); the evidence posted again (3, 4, ...: the pairs died with the store, and the round
    after g would wait for the side they leave out). One store operation a call, as `step`, so that the
    exhaustive test interleaves them with the others' (tests/rdzv_model.py).

    Returns:
        (the next k, None when the re-seed is done; whether generation g was re-decided without this
        participant's list, which makes it stale: end it at the next check).
    """
    tokens = [t for t in evidence.split(",") if t]
    if k == 0:
        ops.set(members_key(g, me), "|".join(members))
        return 1, False
    if k == 1:
        token = f"{me};*;*;{digest(members)}"
        won = ops.compare_set(decision_key(g), "", token)
        if won.decode() == token or won == b"!":
            return 2, False
        leader, _ = decode_decision(won, None, None)
        theirs = peek(ops, members_key(g, leader))
        return 2, theirs is not None and tuple(theirs.decode().split("|")) != members
    if k == 2:
        raise_to(ops, NEXT, g)
        return (3 if tokens else None), False
    add_event(ops, g + 1, tokens[k - 3])
    return (k + 1 if k - 2 < len(tokens) else None), False


def read_events(
    store: Ops, n: int, read: int = 0, holes: tuple[int, ...] = (), blocked: int = 0
) -> tuple[tuple[str, ...], int, tuple[int, ...], int]:
    """Round n's events not read yet: those numbered after `read` and the `holes` (numbered, not written
    when last read), read as the leader's ``check``/``fetch`` phases do: a ``check`` of a batch, halved
    around a hole, then one ``multi_get``; the first new hole ends the reading (`blocked`: the hole the
    last reading ended at, skipped if it still is one). Returns (the new tokens, how far the numbers were
    read, the holes skipped, the hole it ended at or 0)."""
    count = int(peek(store, count_key(n)) or b"0")
    tokens: list[str] = []
    left: list[int] = []
    todo = (*holes, *range(read + 1, count + 1))
    fresh, read = read + 1, max(read, count)
    while todo:
        good = written_prefix(store, n, todo)
        if good:
            tokens += (v.decode() for v in store.multi_get([event_key(n, i) for i in todo[:good]]))
            todo = todo[good:]
            continue
        i = todo[0]
        if i >= fresh and i != blocked:
            return tuple(tokens), i - 1, tuple(left), i
        left.append(i)
        todo = todo[1:]
    return tuple(tokens), read, tuple(left), 0


def read_present(store: Ops, keys: Sequence[str]) -> list[bytes | None]:
    """The values of `keys`, None for those missing, without blocking on them (``multi_get`` would): one
    ``check`` and one ``multi_get`` when all exist, else the same for each half (m missing of n keys:
    about m log n operations, not n)."""
    if len(keys) <= 2:  # as many operations either way
        return [peek(store, k) for k in keys]
    if store.check(list(keys)):
        return list(store.multi_get(list(keys)))
    if len(keys) == 1:
        return [None]
    half = len(keys) // 2
    return read_present(store, keys[:half]) + read_present(store, keys[half:])


def written_prefix(store: Ops, n: int, numbers: Sequence[int]) -> int:
    """How many of round n's events `numbers`, from the first, are written: one ``check`` when all are,
    a binary search (log N checks) around a hole."""
    good, bad, k = 0, 0, len(numbers)
    while True:
        if store.check([event_key(n, i) for i in numbers[:k]]):
            good = k
        else:
            bad = k
        if not bad or bad - good <= 1:
            return good
        k = (good + bad) // 2


def read_round(store: dist.Store, n: int) -> Log:
    """Round n's events and decision as one `Log` (for tests, benchmarks and tools: many operations)."""
    ops = _StoreOps(store)
    tokens: list[str] = []
    read, blocked = 0, -1
    holes: tuple[int, ...] = ()
    while blocked:  # past the holes too (each skipped the second time)
        new, read, holes, blocked = read_events(ops, n, read, holes, max(blocked, 0))
        tokens += new
    raw = peek(ops, decision_key(n))
    if raw == b"!":
        tokens.append("!")
    elif raw is not None:
        leader, _ = decode_decision(raw, None, None)
        members = peek(ops, members_key(n, leader))
        if members is not None:
            tokens.append("=" + members.decode())
    return parse_events(tokens)


class _StoreOps:
    """`Ops` over a torch Store, its keys under `prefix` (its wait's timeout becomes False).

    The prefix is joined here rather than by a `PrefixStore` around `store`: a call then crosses from
    Python to the store once. (A store written in Python, such as a benchmark's counting wrapper, is
    reached through a PrefixStore by torch's trampoline: three takings of the GIL per operation instead
    of one, each a wait behind the other threads of a busy process.)
    """

    def __init__(self, store: dist.Store, prefix: str = "") -> None:
        self.store = store
        self.prefix = prefix

    def check(self, keys: list[str]) -> bool:
        p = self.prefix
        return bool(self.store.check([p + k for k in keys]))

    def set(self, key: str, value: str) -> None:
        self.store.set(self.prefix + key, value)

    def add(self, key: str, value: int) -> int:
        return int(self.store.add(self.prefix + key, value))

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return bytes(self.store.compare_set(self.prefix + key, expected_value, desired_value))

    def wait_for(self, key: str, seconds: float) -> bool:
        try:
            self.store.wait([self.prefix + key], timedelta(seconds=seconds))
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower():
                return False
            raise
        return True

    def multi_get(self, keys: list[str]) -> list[bytes]:
        p = self.prefix
        return list(self.store.multi_get([p + k for k in keys]))

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(self.prefix + key))


#: the phases of a participant that joined a round and waits for its leader's decision
_WAITING = frozenset({"wait", "wake", "sleep", "obsolete?"})


def _seconds(value: timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


T = TypeVar("T")


class _Replaced(Exception):
    """The store restarted empty under a join in progress: the join starts again."""


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


@attrs.define
class _Cursor:
    """How far the monitor read a round's events."""

    round: int = -1
    read: int = 0
    holes: tuple[int, ...] = ()
    blocked: int = 0
    tokens: tuple[str, ...] = ()


class _Link:
    """One connection to the store (the run loop's or the heartbeat thread's), renewed when it broke: a
    torch client keeps a broken connection for good, a new one (`connect`) reaches a restarted store."""

    def __init__(self, base: dist.Store, prefix: str, connect: Callable[[], dist.Store]) -> None:
        self.prefix = prefix
        self.connect = connect
        self._use(base)

    def _use(self, base: dist.Store) -> None:
        self.base = base
        self.epoch = ""  # the store's life (`EPOCH`) read on this connection ("": not read on it yet)
        self.store = dist.PrefixStore(self.prefix, base)
        self.ops = _StoreOps(base, self.prefix + "/")  # the keys the PrefixStore names

    def renew(self) -> bool:
        """A new connection; False when the store cannot be reached now."""
        try:
            base = self.connect()
        except (*_STORE_ERRORS, ElasticError):
            return False
        self._use(base)
        return True


class Rendezvous:
    """One participant of the rounds of run `run_id` over `store` (see docs/rendezvous.md).

    `timeout`: a participant that made no `progress()` for that long stops heartbeating (counts as hung),
    and the store unreachable for that long is an error. Heartbeats every `period` (default: `timeout`/50
    within 0.05..0.1 s); a participant whose counter did not change for `expiry` (default 6 periods) is
    dead to the others, but one that `announce()`d it is on its way to the next round is waited for
    `grace` (default 5 expiries: its abort and garbage collection may hold the GIL for a while).
    `first_workers` (default `min_workers`): how many members the first generation (round 0) needs.
    `last_call` (default 1 s): how long a round that no previous member joined waits for more joiners
    once `min_workers` are there (closes at once with `max_workers`); it is also the bound within which
    the members re-seed a restarted store before a newcomer may decide anything there.
    `connect`: a new client of the store, for when the connection broke (default: ``store.clone()``;
    `elastic.run` tries the addresses of ``rdzv`` in order).
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
        connect: Callable[[], dist.Store] | None = None,
    ) -> None:
        if not participant or any(c in participant for c in ",/;|") or participant[0] in "+-~?=!":
            msg = (
                f"elastic: participant id {participant!r} must be non-empty, contain no ',', '/', ';' or "
                f"'|' and not start with '+', '-', '~', '?', '=' or '!'; use for instance 'host-pid'"
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
        self._prefix = f"elastic/{run_id}/"
        self._connect = connect if connect is not None else self._clone
        self._base = store
        self._link = _Link(store, self._prefix, self._connect)
        self._beat_link: _Link | None = None
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}
        #: per participant: the longest recent excess of a gap between two changes of its counter over the
        #: reading interval, and when (kept across generations: the network a member beats through stays)
        self._jitter: dict[str, tuple[float, float]] = {}
        self._known: set[str] = set()  # participants whose counter exists in this store's life
        self._observed_at: float | None = None  # the last successful read of the heartbeat counters
        #: the monitor's last summary: member -> seconds its counter had not changed (past its `limit`)
        self._ages: dict[str, float] = {}
        self._cursor = _Cursor()
        self._reported: set[tuple[int, str]] = set()  # (round, p): `?p` written
        self._space = process_space()
        #: participant -> its pid when it runs in this process space (same boot, same pid namespace), or
        #: None when it runs elsewhere; participants not yet looked up are absent
        self._pids: dict[str, int | None] = {}
        self._last_progress = time.monotonic()
        self._held = 0  # > 0 while long local work counts as progress (`hold`)
        self._generation = -1
        self._members: tuple[str, ...] = ()
        self._pending = False
        self._stale = False  # this generation was re-decided without it in a restarted store
        self._left = False
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_down_since: float | None = None
        self._epoch = ""  # the store's life this participant knows (`EPOCH`)
        self._seeded = ""  # the store life this participant re-seeded
        self._replaced = 0  # how many times the store was found restarted
        self._reseeded = threading.Event()  # clear while a re-seed of a restarted store is under way
        self._reseeded.set()
        self._counter = 0  # this participant's heartbeat counter, as the store last returned it
        self._beat_at = -math.inf  # when the heartbeat thread last beat (monotonic)
        self._located = ""  # the store's life in which this participant wrote where it runs
        self._renew_main = False  # the heartbeat thread found the store restarted: renew the run loop's
        self._beats = 0
        self._quiet = (-1, -1)  # (round, events read) when the leader's last wait for an event timed out
        self._joining = False  # in `join` (the heartbeat thread reads no summary meanwhile)
        #: joined a round led by another, waiting for its decision: nobody judges this participant by its
        #: heartbeat meanwhile (its join event vouches for it), so it does not beat
        self._waiting = False
        self._evidence: tuple[int, str] = (-1, "")  # (generation, tokens) of the last `unreachable`
        #: when this participant found the store restarted empty (monotonic; None: never)
        self._restarted_at: float | None = None

    # ----------------------------------------------------------------------------------------- public

    @property
    def generation(self) -> int:
        """The last generation this participant was a member of (-1: none yet)."""
        return self._generation

    @property
    def _store(self) -> dist.Store:
        return self._link.store

    def client(self) -> dist.Store:
        """The run loop's store client now (a new one after the store restarted), without prefix."""
        self._main()
        return self._link.base

    def _main(self) -> Ops:
        """The run loop's store operations, on a new connection once the heartbeat thread found the
        store restarted (the old one stays broken)."""
        if self._renew_main:
            self._renew_main = not self._link.renew()
        return self._link.ops

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
        self._main()
        self._enter()
        self._start_thread()
        j = start(self.participant, self._generation, self._members)
        view = _View()
        propose = self._proposer(view)
        gone = self._leader_gone()
        wait = 3 * TICK
        rang = time.monotonic()
        replaced = self._replaced
        joined_at = -1
        self._joining = True
        try:
            while True:
                self.progress()
                before = j
                try:
                    j = self._retry(functools.partial(self._step, j, propose, gone, wait), join=replaced)
                except _Replaced:
                    # the store restarted empty (found by this thread or the heartbeat's): what this join did
                    # was in the old store; start again, in the new one, without running a step of the old
                    # join there (a leader's commit would write an old judgement into the new store), once
                    # the re-seed is done (this participant's re-posted evidence comes before its join)
                    self._reseeded.wait(self.timeout)
                    self._enter()
                    replaced = self._replaced
                    j = start(self.participant, self._generation, self._members)
                    continue
                if self._replaced != replaced:  # the heartbeat thread found the store restarted meanwhile
                    replaced = self._replaced
                    j = start(self.participant, self._generation, self._members)
                    continue
                # between its join event and the decision of a round led by another, a participant's
                # heartbeat is read by nobody: the leader counts it by its event, the next generation's
                # monitor sees every member afresh (at 512 these beats were a third of the herd's load)
                # (a sharded run's spares, which may wait there for long, go on beating)
                self._waiting = (
                    self.fit is None and j.phase in _WAITING and j.leader not in ("", self.participant)
                )
                if j.phase == "done":
                    break
                if before.phase == "put":
                    joined_at = j.round
                if j.phase == "poll" and before.phase in ("count", "check", "fetch"):  # judged: not yet
                    now = time.monotonic()
                    if now > deadline:
                        if self.fit is not None and any(p in view.alive for p in view.prev):
                            # a spare: a generation trains without it; it waits for the next change
                            deadline = now + self.join_timeout
                        else:
                            raise self._join_timeout_error(j, view)
                    if now - rang >= TICK:  # the waiters' sign that their leader still judges
                        self._retry(functools.partial(ring, self._link.ops, j.round))
                        rang = now
                    self._await_event(j)
        finally:
            self._joining = self._waiting = False
        if j.finished:
            log.debug("rendezvous: %s: the run is finished, nothing to join", self.participant)
            return None
        members = j.decision
        with self._lock:
            self._generation = j.round
            self._members = members
            self._pending = self._stale = False
            # a new generation: every member is seen afresh from now (a reading of an earlier round is
            # no baseline: a member judged at it would look stale at once)
            self._ages, self._seen, self._observed_at = {}, {}, None
        log.debug(
            "rendezvous: %s is rank %d of generation %d %s after %.3f s (joined round %d, leader %s)",
            self.participant,
            members.index(self.participant),
            j.round,
            list(members),
            time.monotonic() - began,
            joined_at,
            j.leader,
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
        self._write(f"~{self.participant}", "announce its regroup")

    def pending(self) -> bool:
        """Someone waits to join, a member left or announced a regroup, or a newer generation formed: end
        this generation at the next check. Reads no store: the heartbeat thread refreshes it every
        `period`."""
        return self._pending

    def alive(self) -> set[str]:
        """The members of the current generation whose heartbeat is fresh (one store read: the monitor's
        summary, or on the monitor every member's counter; this participant counts while it makes
        progress)."""
        members = self._members
        with contextlib.suppress(*_STORE_ERRORS):
            self._refresh(self._main())
        gone = set(self.expired())
        fresh = {p for p in members if p != self.participant and p not in gone}
        if self.participant in members and self._making_progress(time.monotonic()):
            fresh.add(self.participant)
        return fresh

    def expired(self, within: float | None = None) -> list[str]:
        """The other members of the current generation that are gone as last seen: their process exited
        (same host), or their counter had not changed for `within` seconds (default: its `limit`) when it
        was last read (by the monitor, or by this participant for the monitor itself). Reads no store. Judged
        at the reads, not now: a participant whose own heartbeat thread was held up (the GIL, an
        unreachable store) sees nobody expire until it reads again, so it never blames its peers for its
        own stall."""
        with self._lock:
            members, observed = self._members, self._observed_at
            seen, ages = dict(self._seen), dict(self._ages)
        exited = self.exited()
        limit = self.expiry if within is None else within
        monitor = members[0] if members else ""
        out = []
        for p in members:
            if p == self.participant:
                continue
            if p in exited:
                out.append(p)
            elif self.participant == monitor or p == monitor:
                last = seen.get(p)
                if last is None or observed is None:
                    continue
                if observed - last.changed > max(limit, self.limit(p, observed)):
                    out.append(p)
            elif ages.get(p, 0.0) > limit:
                out.append(p)
        return out

    def leave(self) -> None:
        """A planned departure: the others end the generation at their next check and go on without it."""
        self._left = True
        self._write(f"-{self.participant}", "announce its departure")

    def unreachable(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Report pairs that cannot connect, ``(a, b)``: a could not connect to b. The next round keeps only
        the largest set of its candidates with no such pair (`elastic.recovery.partition`); the others are
        not members of it (nor waited for). One store write; fails soft.

        Args:
            pairs: ``(a, b)`` participant ids, this participant's findings.
        """
        tokens = "".join(f"x{a}|{b}," for a, b in pairs if a != b)
        if tokens:
            self._evidence = (self._generation, tokens)  # posted again if the store restarts empty
            self._write(tokens, "report the participants it cannot connect to")

    def beating(self, names: Iterable[str]) -> set[str]:
        """Those of `names` whose heartbeat counter changed within `expiry`, read now (one multi_get;
        a participant never seen before counts as beating until it has stood still for `expiry`). For a
        participant waiting outside the rendezvous, whose generation's summary no longer moves."""
        names = [p for p in names if p != self.participant]
        with contextlib.suppress(*_STORE_ERRORS):
            self._observe(self._main(), names)
        now = time.monotonic()
        return {p for p in names if self._fresh(p, now, self.expiry)} | {self.participant}

    def finish(self) -> None:
        """The function returned in the current generation: the run is finished, every later join (and any
        join waiting in the next round) returns None. Fails soft."""
        try:
            ops = self._main()
            ops.set(FINISHED, str(self._generation))
            ops.compare_set(decision_key(self._generation + 1), "", "!")
            ring(ops, self._generation + 1)
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
            thread.join(timeout=max(1.0, 4 * self.period) + RECONNECT)
            if not thread.is_alive():
                self._beat_link = None

    # ---------------------------------------------------------------------------------------- private

    def _await_event(self, j: Joiner) -> None:
        """The leader judged "not yet": wait for the round's next unread event (the hole its reading
        stopped at, or the next number) to be written, at most a poll's interval (20 ms), instead of
        sleeping that long: the last joiner of a regroup's herd is read as soon as it wrote its event.
        Once such a wait timed out, it sleeps until the reading moves on (torch logs two warnings for
        every store wait that times out: one per quiet stretch, not fifty a second). A store error is the
        next step's to handle (it retries)."""
        seconds = min(0.02, self.period / 2)
        began = time.monotonic()
        if self._quiet != (j.round, j.read):
            try:
                if self._link.ops.wait_for(event_key(j.round, j.read + 1), seconds):
                    return
                self._quiet = (j.round, j.read)
            except _STORE_ERRORS:
                pass
        time.sleep(max(0.0, seconds - (time.monotonic() - began)))

    def _step(self, j: Joiner, propose: Propose, gone: Gone, wait: float) -> Joiner:
        return step(j, self._link.ops, propose, gone=gone, seen=self._see, fit=self.fit, wait=wait)

    def _see(self, p: str) -> None:
        self._observe(self._link.ops, [p])

    def _clone(self) -> dist.Store:
        """A new client of the same store. A TCPStore's is made directly, with a short connect timeout
        (a thread retrying a store that is down must stay responsive to `close`), then the usual one."""
        base = self._base
        if isinstance(base, dist.TCPStore):  # probed first: refused at once while down (torch waits 0.4-1 s)
            attempt = timedelta(seconds=min(self.timeout, RECONNECT))
            return client(base.host, base.port, timeout=base.timeout, attempt=attempt)  # type: ignore[attr-defined]
        return base.clone()  # type: ignore[attr-defined]

    def _enter(self) -> None:
        """Before a join: beat, learn the store's life (or name it), say where this participant runs.

        Each only when needed (a regroup's herd of members, at 512, waited behind these operations): no
        beat when the heartbeat thread beat within a period (a joiner is vouched for by its join event
        anyway; a newcomer's first beat makes its counter exist); no read of the store's life when this
        connection read it already (a restarted store breaks the connection, and every new one reads it:
        `_reconnected`); where it runs once per store life (`_reseed` writes it again)."""
        if not (
            self._thread is not None
            and self._store_down_since is None
            and time.monotonic() - self._beat_at < self.period
        ):
            self._retry(lambda: self._link.ops.add(hb_key(self.participant), 1))
        if not (self._epoch and self._link.epoch == self._epoch):
            link = self._link
            token = self._retry(lambda: self._link.ops.compare_set(EPOCH, "", secrets.token_hex(8))).decode()
            if self._epoch and token != self._epoch:
                self._reseed(self._link.ops, token)
            self._epoch = token
            if link is self._link:  # (not renewed by a retry meanwhile: that one read it itself)
                link.epoch = token
        if self._space and self._located != self._epoch:
            # before this participant's first join event: peers look it up once they see one
            where = f"{self._space}|{os.getpid()}"
            self._retry(lambda: self._link.ops.set(where_key(self.participant), where))
            self._located = self._epoch

    def _reconnected(self, link: _Link) -> bool:
        """After `link` was renewed: did the store restart (another life)? Then re-seed it."""
        raw = link.ops.compare_set(EPOCH, "", secrets.token_hex(8)).decode()
        link.epoch = raw
        if raw == self._epoch:
            return False
        log.warning(
            "rendezvous: %s found the store at %s restarted empty; re-seeding generation %d",
            self.participant,
            self.address or "?",
            self._generation,
        )
        self._reseed(link.ops, raw)
        return True

    def _reseed(self, ops: Ops, epoch: str) -> None:
        """The store restarted empty: write what the run needs of this participant's generation (its
        members and ``next``), so that no newcomer forms a generation of its own there."""
        with self._lock:
            if self._seeded == epoch:
                self._epoch = epoch
                return
            self._seeded = epoch
            self._epoch = epoch
            self._reseeded.clear()
            self._replaced += 1
            self._renew_main = True
            self._restarted_at = time.monotonic()
            self._known = set()
            g, members = self._generation, self._members
        try:
            ops.add(hb_key(self.participant), 1)
            if self._space:
                ops.set(where_key(self.participant), f"{self._space}|{os.getpid()}")
                self._located = epoch
            if g < 0:
                return
            generation, tokens = self._evidence  # the pairs this participant reported after generation g
            k: int | None = 0
            while k is not None:
                k, stale = reseed(ops, self.participant, g, members, tokens if generation == g else "", k)
                if stale:
                    # another generation g was decided there first (this one's members were too slow to
                    # re-seed): this generation is stale, end it at the next check
                    log.warning(
                        "rendezvous: %s: generation %d was re-decided without it", self.participant, g
                    )
                    self._stale = self._pending = True
            self._cursor = _Cursor()
        finally:
            self._reseeded.set()

    def _write(self, event: str, what: str) -> None:
        """Append `event` to the next round's events (this participant's generation is over for it)."""
        if self._generation < 0:
            return
        try:
            ops = self._main()
            for token in event.split(","):
                if token:
                    add_event(ops, self._generation + 1, token)
        except _STORE_ERRORS as exc:
            log.warning(
                "rendezvous: %s could not %s to the store at %s (%s); the others will see its heartbeat stop",
                self.participant,
                what,
                self.address or "?",
                exc,
            )

    @property
    def stale_cap(self) -> float:
        """The longest a training generation's member's heartbeat may stand still, through the lossiest
        network: 4 expiries, at least 2 s (`run`'s watch allows 2 expiries, at least 1 s, or a member's
        `limit` when that is longer).

        Returns:
            Seconds.
        """
        return max(4 * self.expiry, 2.0)

    def limit(self, p: str, now: float | None = None) -> float:
        """How long p's heartbeat may stand still in a training generation before p is judged gone:
        `expiry` plus `JITTER` times p's recent jitter (the longest excess of a gap between two changes of
        its counter over the reading interval, its weight halving every `JITTER_HALF_LIFE` seconds), at
        most `stale_cap`. On a clean network that is `expiry`; through lost packets, whose
        retransmissions hold a beat 0.2 s (0.6 s for two in a row, 1.4 s for three), about 1.2-1.8 s, so
        that a member whose beat waited for retransmissions does not end the generation.

        Args:
            p: a participant id.
            now: the time (``time.monotonic()``) at which to judge; default now.

        Returns:
            Seconds.
        """
        return min(self.stale_cap, self.expiry + JITTER * self._recent(p, now))

    def _recent(self, p: str, now: float | None = None) -> float:
        jitter = self._jitter.get(p)
        if jitter is None:
            return 0.0
        excess, at = jitter
        now = time.monotonic() if now is None else now
        return excess * 0.5 ** (max(0.0, now - at) / JITTER_HALF_LIFE)

    def _fresh(self, p: str, now: float, within: float) -> bool:
        """p's counter changed within `within` seconds (a participant never seen yet counts as fresh), and
        p's process has not exited (known at once for a participant of this process space)."""
        pid = self._pids.get(p)
        if pid is not None and not running(pid):
            return False
        seen = self._seen.get(p)
        return seen is None or now - seen.changed <= within

    def _locate(self, store: dist.Store | Ops, names: list[str]) -> None:
        """Learn, once per participant, whether it runs in this process space and with which pid: a
        participant on this host whose process has exited is dead at once, without waiting for its
        heartbeat to expire (a SIGKILLed worker). Elsewhere its heartbeat alone decides."""
        for p in names:
            if p in self._pids or not self._space:
                continue
            raw = peek(_ops(store), where_key(p))
            if raw is None:
                continue
            space, _, pid = raw.decode().rpartition("|")
            self._pids[p] = int(pid) if space == self._space and pid.isdigit() else None

    def _observe(self, store: dist.Store | Ops, names: Iterable[str], learn: bool = False) -> None:
        """Read the heartbeat counters of `names` (one multi_get) and note when each last changed (`learn`:
        members of the training generation, beating every period: their gaps count toward `limit`)."""
        names = list(names)
        if not names:
            return
        ops = _ops(store)
        self._locate(ops, names)
        # multi_get blocks on a missing key: read it only for counters known to exist in this store's
        # life; the others (never beaten here: dead before a restart, or not yet back) one by one
        known = [p for p in names if p in self._known]
        values = dict(zip(known, ops.multi_get([hb_key(p) for p in known]))) if known else {}
        unknown = [p for p in names if p not in self._known]
        for p, raw in zip(unknown, read_present(ops, [hb_key(p) for p in unknown])):
            if raw is not None:
                self._known.add(p)
                values[p] = raw
        now = time.monotonic()
        with self._lock:
            before, self._observed_at = self._observed_at, now
            for p in names:
                raw = values.get(p)
                counter = int(raw.decode() or 0) if raw is not None else -1
                self._note(p, counter, now, before if learn else None)

    def _note(self, p: str, counter: int, now: float, before: float | None = None) -> None:
        """p's counter read at `now`; `before`: this reader's previous reading, of a training generation
        whose members beat every period: how much longer than it p's counter stood still is jitter."""
        seen = self._seen.get(p)
        if seen is None or seen.counter != counter:
            self._seen[p] = _Seen(counter, now)
            if before is not None and seen is not None and seen.counter >= 0 and counter >= 0:
                gap = now - seen.changed
                excess = gap - (now - before)
                # a longer absence is no jitter: the member was judged gone at the cap (or waited outside)
                if excess > 0 and gap <= self.stale_cap and excess > self._recent(p, now):
                    self._jitter[p] = (excess, now)

    def _proposer(self, view: _View) -> Propose:
        def propose(n: int, prev: tuple[str, ...], events: Log, orphan: bool) -> tuple[str, ...] | None:
            if view.round != n or view.events != events:
                view.round, view.events, view.changed = n, events, time.monotonic()
            # Only the members of the previous generation that have not joined are read: a joiner is
            # alive (its join is the sign), a member judged dead by its observer is dead.
            missing = [
                p
                for p in prev
                if p != self.participant
                and p not in events.joined
                and p not in events.left
                and p not in events.suspected
            ]
            self._observe(self._link.ops, missing)
            now = time.monotonic()

            # A member that announced its regroup may be stalled in its abort: wait `grace` for it. So
            # does a round no previous member joined yet (a joiner while the generation trains, or every
            # member dead): it is never urgent, and a generation stalled in its start (imports, group
            # init, garbage collection hold the GIL) must not look dead to a newcomer.
            nobody = not any(q in prev for q in events.joined)

            def alive(p: str) -> bool:
                if p == self.participant or p in events.joined:
                    return p not in events.left
                if p in events.suspected:
                    return False
                within = self.grace if p in events.announced or (nobody and p in prev) else self.expiry
                return self._fresh(p, now, within)

            view.prev = prev
            view.alive = tuple(p for p in dict.fromkeys((*prev, *events.joined)) if alive(p))
            quiet = now - view.changed >= self.last_call
            restarted = self._restarted_at
            if restarted is not None and now - restarted < self.last_call:
                # a store restarted empty: the other members may not have re-seeded it yet (a decision
                # they took there before may be gone): judge nothing until they had the time (SPIN model)
                return None
            if orphan and not quiet:
                # no previous generation in the store (the first round, or a store restarted empty): wait
                # for the members' re-seed whatever joined, even max_workers (the SPIN model found it)
                return None
            return decide(
                prev,
                events,
                alive=alive,
                ready=alive,
                min_workers=self.first_workers if n == 0 else self.min_workers,
                max_workers=self.max_workers,
                quiet=quiet,
                fit=self.fit,
            )

        return propose

    def _leader_gone(self) -> Gone:
        def gone(leader: str) -> bool:
            self._observe(self._link.ops, [leader])
            return not self._fresh(leader, time.monotonic(), self.expiry)

        return gone

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

    def _retry(self, op: Callable[[], T], *, join: int | None = None) -> T:
        """`op()`, retried while the store is unreachable, for at most `timeout`; the connection is
        renewed after a failure. `join`: the store restarts a join has seen (`_replaced` when it began):
        raise `_Replaced` instead of running `op` again once the store turns out to have restarted since,
        whichever thread found it (the heartbeat thread may have re-seeded it already)."""
        down_since: float | None = None
        while True:
            if join is not None and self._replaced != join:
                raise _Replaced
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
                if self._link.renew():
                    with contextlib.suppress(*_STORE_ERRORS):
                        self._reconnected(self._link)

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        if self._beat_link is None:
            try:
                self._beat_link = _Link(self._connect(), self._prefix, self._connect)
            except (*_STORE_ERRORS, ElasticError, AttributeError):
                # the run loop's client, shared, behind a link of its own: when the heartbeat thread renews
                # it, the run loop's stays broken until its own retry finds the restart (`_retry`)
                self._beat_link = _Link(self._link.base, self._prefix, self._connect)
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._beat_loop, name=f"elastic-heartbeat-{self.participant}", daemon=True
        )
        self._thread.start()

    def _beat_wait(self) -> float:
        """Seconds until the next beat: a period, or less for the monitor when a member's counter is about to
        have stood still for its `limit`: it reads the counters again just after, so that a dead member is
        flagged at its limit rather than up to a period later (0.05 s on average with a 0.1 s period)."""
        now = time.monotonic()
        with self._lock:
            members = self._members
            if not members or members[0] != self.participant:
                return self.period
            soonest = min(
                (s.changed + self.limit(p, now) for p in members[1:] if (s := self._seen.get(p)) is not None),
                default=None,
            )
        if soonest is None:
            return self.period
        left = soonest - now + 0.005
        return min(self.period, left) if left > 0 else self.period

    def _beat_loop(self) -> None:
        link = self._beat_link if self._beat_link is not None else self._link
        while not self._stop.wait(self._beat_wait()):
            try:
                if self._store_down_since is not None:
                    if not link.renew():
                        continue
                    self._reconnected(link)
                self._beat_once(link.ops)
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

    def _beat_once(self, ops: Ops) -> None:
        if self._making_progress(time.monotonic()) and not self._waiting:
            self._counter = ops.add(hb_key(self.participant), 1)
            self._beat_at = time.monotonic()
        self._beats += 1
        with self._lock:
            monitor = bool(self._members) and self._members[0] == self.participant
        if not monitor and (self._joining or self._beats % FOLLOW_EVERY):
            # the others read the monitor's summary every FOLLOW_EVERY periods, and not while they join: a
            # joiner's generation is over for it (what it would read is the join's business), and at 512
            # participants those reads were a third of the heartbeats' load on the regroup's herd
            return
        self._refresh(ops, write=True)

    def _refresh(self, ops: Ops, *, write: bool = False) -> None:
        """Read what liveness and `pending` need this period: the monitor (rank 0) every member's counter,
        the next round's new events and whether it is decided, then writes its summary (`write`); every
        other member the summary alone. Then `pending()` says whether the generation must end, unless a
        join made this participant a member of a newer generation meanwhile: what was read is about the
        old one (which is over), and a new generation starts with nothing pending."""
        with self._lock:
            g, members = self._generation, self._members
        if g < 0 or not members:
            return
        if members[0] == self.participant:
            pending = self._monitor(ops, g, members, write)
        else:
            pending = self._follow(ops, g, members)
        with self._lock:
            if self._generation == g:
                self._pending = pending or self._stale

    def _monitor(self, ops: Ops, g: int, members: tuple[str, ...], write: bool) -> bool:
        others = [p for p in members if p != self.participant]
        self._observe(ops, others, learn=True)
        c = self._cursor if self._cursor.round == g + 1 else _Cursor(round=g + 1)
        new, read, holes, blocked = read_events(ops, g + 1, c.read, c.holes, c.blocked)
        tokens = (*c.tokens, *new)
        self._cursor = c = _Cursor(round=g + 1, read=read, holes=holes, blocked=blocked, tokens=tokens)
        events = parse_events(c.tokens)
        decided = ops.check([decision_key(g + 1)])
        now = time.monotonic()
        with self._lock:
            observed = self._observed_at if self._observed_at is not None else now
            ages = {
                p: observed - s.changed
                for p in others
                if (s := self._seen.get(p)) is not None and observed - s.changed > self.limit(p, observed)
            }
        # a member that joined the next round is not judged by its heartbeat: it waits there, not beating
        joined = set(events.joined)
        dead = [p for p in others if p not in joined and (p in ages or p in self.exited())]
        for p in dead:
            if (g + 1, p) not in self._reported and p not in events.suspected:
                if p in ages:
                    log.debug(
                        "rendezvous: %s flags %s: its counter stood still %.2f s (its limit %.2f s)",
                        self.participant,
                        p,
                        ages[p],
                        self.limit(p, observed),
                    )
                add_event(ops, g + 1, f"?{p}")
                self._reported.add((g + 1, p))
        pending = decided or bool(dead) or pending_from(events, members, self.max_workers, self.fit)
        if write:
            listed = "|".join(f"{p}:{int(age * 1000)}" for p, age in ages.items())
            ops.set(summary_key(g), f"{self._counter};{int(pending)};{listed}")
        return pending

    def _follow(self, ops: Ops, g: int, members: tuple[str, ...]) -> bool:
        monitor = members[0]
        raw = peek(ops, summary_key(g))
        if raw is None:
            # no summary yet: the monitor has not started on this generation (its join may return last of
            # all, a regroup's herd later): judge it by its own heartbeat counter meanwhile, the value
            # the summary carries, or a slow start would look like a dead monitor
            self._observe(ops, [monitor], learn=True)
            raw_before = None
        else:
            raw_before = self._observed_at
        now = time.monotonic()
        pending = False
        ages: dict[str, float] = {}
        with self._lock:
            if raw is not None:
                counter, flag, listed = raw.decode().split(";")
                self._note(monitor, int(counter or 0), now, raw_before)
                pending = flag == "1"
                for item in listed.split("|") if listed else ():
                    p, _, ms = item.rpartition(":")
                    ages[p] = int(ms) / 1000
            self._observed_at = now
            self._ages = ages
        self._locate(ops, [monitor])
        if not self._fresh(monitor, now, self.limit(monitor, now)):
            if (g + 1, monitor) not in self._reported:
                add_event(ops, g + 1, f"?{monitor}")
                self._reported.add((g + 1, monitor))
            pending = True
        return pending


def _ops(store: dist.Store | Ops) -> _StoreOps:
    if isinstance(store, _StoreOps):
        return store
    return _StoreOps(store)  # type: ignore[arg-type]
