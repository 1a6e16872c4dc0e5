"""Exhaustive exploration of the round protocol (`elastic.recovery.rendezvous.step`) in memory.

Every participant is a program over the protocol's own state machine: it trains in a generation, and
joins the next round when its generation is broken (a peer crashed, left or went on), when `pending()`
says so, or once spuriously; it may announce, leave or finish. Each transition is ONE store operation of
one participant (or a crash), so the search covers every interleaving of their operations. Heartbeats are
an oracle: truthful (a crashed participant is dead) or, within a budget, wrong about a live participant
(a hung or GIL-stalled one that looks dead). Used by tests/recovery/test_rendezvous.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Iterator

import attrs

import elastic.recovery.rendezvous as rendezvous
from elastic.recovery.rendezvous import (
    FINISHED,
    NEXT,
    Joiner,
    Log,
    add_event,
    count_key,
    decide,
    decision_key,
    encode_decision,
    event_key,
    members_key,
    parse_events,
    peek,
    pending_from,
    ring,
    start,
    step,
)


class MemStore:
    """The store operations of `elastic.recovery.rendezvous.Ops` on a dict, with TCPStore's semantics.
    `wait_for` never blocks: a missing key is a wait that timed out (time passed)."""

    def __init__(self, items: tuple[tuple[str, bytes], ...] = ()) -> None:
        self.data: dict[str, bytes] = dict(items)

    def frozen(self) -> tuple[tuple[str, bytes], ...]:
        return tuple(sorted(self.data.items()))

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def add(self, key: str, value: int) -> int:
        new = int(self.data.get(key, b"0").decode() or 0) + value
        self.data[key] = str(new).encode()
        return new

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        current = self.data.get(key)
        if (current is None and expected_value == "") or current == expected_value.encode():
            self.data[key] = desired_value.encode()
        elif current is None:
            return expected_value.encode()
        return self.data[key]

    def wait_for(self, key: str, seconds: float) -> bool:
        return key in self.data

    def multi_get(self, keys: list[str]) -> list[bytes]:
        missing = [k for k in keys if k not in self.data]
        assert not missing, f"multi_get of missing keys {missing} blocks (TCPStore waits for them)"
        return [self.data[k] for k in keys]

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


def events_of(store: MemStore, n: int) -> Log:
    count = int(store.data.get(count_key(n), b"0").decode() or 0)
    return parse_events(
        raw.decode() for i in range(1, count + 1) if (raw := store.data.get(event_key(n, i))) is not None
    )


def members_of(store: MemStore, n: int) -> tuple[str, ...]:
    raw = peek(store, decision_key(n))
    if raw is None or raw == b"!":
        return ()
    leader = raw.decode().split(";")[0]
    full = peek(store, members_key(n, leader))
    return tuple(full.decode().split("|")) if full else ()


def decided_rounds(store: MemStore) -> list[int]:
    return sorted(int(k[2:]) for k, v in store.data.items() if k.startswith("d/") and v != b"!")


def pending(store: MemStore, gen: int, members: tuple[str, ...], cfg: Config) -> bool:
    """What the monitor of `gen` computes and every member reads (`Rendezvous._monitor`)."""
    events = events_of(store, gen + 1)
    if store.check([decision_key(gen + 1)]):
        return True
    return pending_from(events, members, cfg.max_workers)


@attrs.frozen
class Worker:
    """One participant's program state."""

    name: str
    status: str  # new | idle (training in `gen`) | joining | crashed | left | finished | none (got None)
    gen: int = -1
    joiner: Joiner | None = None
    history: tuple[int, ...] = ()  # generations it was a member of, in order
    spurious: int = 0  # spurious regroups left (a collective failing for no visible reason)
    started_after_finish: bool = False


@attrs.frozen
class State:
    store: tuple[tuple[str, bytes], ...]
    workers: tuple[Worker, ...]
    crashes: int  # crashes left
    suspicions: int  # wrong heartbeat judgements left
    leaves: int
    finishes: int


@attrs.frozen
class Config:
    names: tuple[str, ...]
    min_workers: int = 1
    max_workers: int = 1 << 30
    crashes: int = 1
    suspicions: int = 0
    leaves: int = 0
    finishes: int = 0
    spurious: int = 0
    initial: tuple[str, ...] = ()  # generation 0, already formed (empty: everybody starts fresh)
    newcomers: tuple[str, ...] = ()  # start fresh even when `initial` is given
    who_crashes: tuple[str, ...] = ()  # who may crash (empty: anybody)

    def crashers(self, name: str) -> tuple[str, ...]:
        return self.who_crashes or self.names


def initial_state(cfg: Config) -> State:
    store = MemStore()
    workers = []
    if cfg.initial:
        for p in cfg.initial:
            add_event(store, 0, f"+{p}")
        leader = cfg.initial[0]
        store.set(members_key(0, leader), "|".join(cfg.initial))
        store.set(decision_key(0), encode_decision(leader, cfg.initial, ()))
        store.set(NEXT, "1")
    for name in cfg.names:
        member = name in cfg.initial and name not in cfg.newcomers
        workers.append(
            Worker(
                name=name,
                status="idle" if member else "new",
                gen=0 if member else -1,
                history=(0,) if member else (),
                spurious=cfg.spurious,
            )
        )
    return State(store.frozen(), tuple(workers), cfg.crashes, cfg.suspicions, cfg.leaves, cfg.finishes)


def broken(state: State, store: MemStore, w: Worker) -> bool:
    """Would a collective of `w`'s generation fail? (a member crashed, left or is elsewhere)"""
    by_name = {x.name: x for x in state.workers}
    for m in members_of(store, w.gen):
        other = by_name[m]
        if m == w.name or (other.status == "idle" and other.gen == w.gen):
            continue
        if other.status == "joining" and other.joiner is not None and other.joiner.round <= w.gen:
            continue  # still on its way into this generation: its group's init waits for it
        return True
    return False


def _oracles(
    state: State, w: Worker, j: Joiner, events: Log, cfg: Config
) -> Iterator[tuple[frozenset[str], bool]]:
    """(participants judged dead, whether this costs a suspicion) for one judging step."""
    crashed = frozenset(x.name for x in state.workers if x.status == "crashed")
    yield crashed, False
    if state.suspicions > 0:
        names = {*(j.prev or ()), *events.joined, j.leader}
        live_others = sorted(p for p in names if p and p != w.name and p not in crashed)
        for p in live_others:
            yield crashed | {p}, True


def successors(state: State, cfg: Config) -> Iterator[tuple[str, State, bool]]:
    """(label, next state, fair) for every transition; `fair`: truthful oracle and no fault."""
    for i, w in enumerate(state.workers):
        store = MemStore(state.store)

        def put(nw: Worker, st: MemStore, i: int = i, **changes: int) -> State:
            workers = list(state.workers)
            workers[i] = nw if nw.status in ("new", "idle", "joining") else Worker(nw.name, nw.status)
            return attrs.evolve(state, store=st.frozen(), workers=tuple(workers), **changes)

        if w.status in ("new", "idle", "joining") and state.crashes > 0 and w.name in cfg.crashers(w.name):
            yield (
                f"{w.name} crashes",
                put(attrs.evolve(w, status="crashed"), store, crashes=state.crashes - 1),
                False,
            )
        if w.status == "new":
            finished = store.check([FINISHED])
            nw = attrs.evolve(w, status="joining", joiner=start(w.name, -1), started_after_finish=finished)
            yield f"{w.name} starts", put(nw, store), True
        elif w.status == "idle":
            members = members_of(store, w.gen)
            finished = store.check([FINISHED])
            must = broken(state, store, w) or pending(store, w.gen, members, cfg)
            if must or w.spurious > 0:
                nw = attrs.evolve(
                    w,
                    status="joining",
                    joiner=start(w.name, w.gen, members),
                    spurious=w.spurious - (0 if must else 1),
                    started_after_finish=finished,
                )
                yield f"{w.name} regroups", put(nw, store), must
                if must:
                    st = MemStore(state.store)
                    add_event(st, w.gen + 1, f"~{w.name}")
                    yield f"{w.name} announces and regroups", put(nw, st), True
            if state.leaves > 0:
                st = MemStore(state.store)
                add_event(st, w.gen + 1, f"-{w.name}")
                yield (
                    f"{w.name} leaves",
                    put(attrs.evolve(w, status="left"), st, leaves=state.leaves - 1),
                    False,
                )
            if state.finishes > 0 and not must:
                st = MemStore(state.store)
                st.set(FINISHED, str(w.gen))
                st.compare_set(decision_key(w.gen + 1), "", "!")
                ring(st, w.gen + 1)
                nw = attrs.evolve(w, status="finished")
                yield f"{w.name} finishes", put(nw, st, finishes=state.finishes - 1), False
        elif w.status == "joining":
            j = w.joiner
            assert j is not None
            if j.phase in ("count", "check", "fetch", "sleep"):
                events = parse_events(j.events)
                outcomes: set[Joiner] = set()
                for dead, costs in _oracles(state, w, j, events, cfg):
                    for quiet in (True, False):
                        st = MemStore(state.store)

                        def propose(
                            n: int,
                            prev: tuple[str, ...],
                            ev: Log,
                            orphan: bool,
                            dead: frozenset[str] = dead,
                            q: bool = quiet,
                            me: str = w.name,
                        ) -> tuple[str, ...] | None:
                            def alive(p: str) -> bool:
                                return p == me or p not in dead

                            return decide(
                                prev,
                                ev,
                                alive=alive,
                                ready=alive,
                                min_workers=cfg.min_workers,
                                max_workers=cfg.max_workers,
                                quiet=q,
                            )

                        def gone(leader: str, dead: frozenset[str] = dead) -> bool:
                            return leader in dead

                        nj = step(j, st, propose, gone=gone)
                        if nj in outcomes:
                            continue
                        outcomes.add(nj)
                        label = f"{w.name} {j.phase} dead={sorted(dead)} quiet={quiet}"
                        yield (
                            label,
                            put(_advance(w, nj), st, suspicions=state.suspicions - int(costs)),
                            not costs,
                        )
            else:
                st = MemStore(state.store)
                nj = step(j, st, _no_proposal)
                yield f"{w.name} {j.phase}", put(_advance(w, nj), st), True


def _no_proposal(n: int, prev: tuple[str, ...], ev: Log, orphan: bool) -> tuple[str, ...] | None:
    msg = "propose called outside the judging phases"
    raise AssertionError(msg)


def _advance(w: Worker, j: Joiner) -> Worker:
    if j.phase != "done":
        return attrs.evolve(w, joiner=j)
    if j.finished:
        return attrs.evolve(w, status="none", joiner=None)
    return attrs.evolve(w, status="idle", gen=j.round, joiner=None, history=(*w.history, j.round))


def check_safety(state: State, cfg: Config) -> None:
    """The protocol's properties in one reachable state; AssertionError naming the violation."""
    store = MemStore(state.store)
    rounds = decided_rounds(store)
    for n in rounds:
        members = members_of(store, n)
        assert members, f"round {n}: decided, but its leader's list of members is missing"
        assert len(set(members)) == len(members), f"round {n}: a participant twice in {members}"
        assert cfg.min_workers <= len(members) <= cfg.max_workers, f"round {n}: size of {members}"
        joined = events_of(store, n).joined
        assert all(m in joined for m in members), f"round {n}: {members} did not all join: {joined}"
        if n > 0:
            assert n - 1 in rounds, f"round {n} decided before round {n - 1}"
    for w in state.workers:
        # one membership per generation, agreed by every member: what it holds is the store's decision
        for g in w.history:
            assert w.name in members_of(store, g), (
                f"{w.name} thinks it is in generation {g}: {members_of(store, g)}"
            )
        assert list(w.history) == sorted(set(w.history)), f"{w.name}: generations not increasing {w.history}"
        if w.status == "idle":
            assert w.history and w.history[-1] == w.gen
            # at most one generation training: an older generation is told to end
            newer = [n for n in rounds if n > w.gen]
            if newer:
                assert pending(store, w.gen, members_of(store, w.gen), cfg), (
                    f"{w.name} trains in generation {w.gen} while {newer} are decided, and pending() is False"
                )
        if w.status == "none":
            assert store.check([FINISHED]), f"{w.name} got None but the run is not finished"
        if w.started_after_finish:
            assert w.status in ("joining", "none", "crashed"), f"{w.name} joined after the run finished"
            if w.status == "joining":
                assert w.joiner is not None and w.joiner.phase in ("fin",), (
                    f"{w.name} started after finish but went on to phase {w.joiner}"
                )


def goal(state: State, cfg: Config) -> bool:
    """Quiescence: every live trainer in the latest generation, with all its members, and nobody joining
    but spares (the generation has `max_workers`) or workers that cannot reach `min_workers`."""
    if any(w.status == "new" for w in state.workers):
        return False
    store = MemStore(state.store)
    joining = [w for w in state.workers if w.status == "joining"]
    if store.check([FINISHED]):
        return not joining
    trainers = [w for w in state.workers if w.status == "idle"]
    if trainers:
        latest = max(decided_rounds(store))
        members = set(members_of(store, latest))
        if not (all(w.gen == latest for w in trainers) and members == {w.name for w in trainers}):
            return False
    if not joining:
        return True
    return len(trainers) >= cfg.max_workers or len(trainers) + len(joining) < cfg.min_workers


@attrs.frozen
class Result:
    states: int
    transitions: int
    decided_sizes: frozenset[tuple[int, int]]  # (round, size) seen decided
    stragglers: int  # transitions where a participant found its round decided without it


@contextlib.contextmanager
def _cached_parse() -> Iterator[None]:
    """`parse_events` memoized while exploring (it is pure; the search parses the same events again and
    again)."""
    original = rendezvous.parse_events
    cached = functools.lru_cache(maxsize=None)(lambda tokens: original(tokens))
    rendezvous.parse_events = lambda tokens: cached(tuple(tokens))  # type: ignore[assignment]
    try:
        yield
    finally:
        rendezvous.parse_events = original  # type: ignore[assignment]


def explore(cfg: Config, *, limit: int = 2_000_000) -> Result:
    """Every reachable state: safety in each, and from each a fair path to quiescence (AG EF goal)."""
    with _cached_parse():
        return _explore(cfg, limit)


def _explore(cfg: Config, limit: int) -> Result:
    init = initial_state(cfg)
    index: dict[State, int] = {init: 0}
    states = [init]
    fair_preds: list[list[int]] = [[]]
    queue = deque([0])
    transitions = 0
    sizes: set[tuple[int, int]] = set()
    stragglers = 0
    while queue:
        si = queue.popleft()
        s = states[si]
        check_safety(s, cfg)
        store = MemStore(s.store)
        for n in decided_rounds(store):
            sizes.add((n, len(members_of(store, n))))
        for _label, t, fair in successors(s, cfg):
            transitions += 1
            for before, after in zip(s.workers, t.workers):
                if (
                    before.joiner is not None
                    and after.joiner is not None
                    and after.joiner.round > before.joiner.round
                    and after.joiner.phase == "fin"
                ):
                    stragglers += 1
            ti = index.get(t)
            if ti is None:
                ti = len(states)
                index[t] = ti
                states.append(t)
                fair_preds.append([])
                queue.append(ti)
                if len(states) > limit:
                    msg = f"more than {limit} states: make the configuration smaller"
                    raise AssertionError(msg)
            if fair:
                fair_preds[ti].append(si)
        del store
    # AG EF goal: backward search over fair transitions from the goal states
    good = [goal(s, cfg) for s in states]
    work = deque(i for i, g in enumerate(good) if g)
    while work:
        ti = work.popleft()
        for si in fair_preds[ti]:
            if not good[si]:
                good[si] = True
                work.append(si)
    stuck = [states[i] for i, g in enumerate(good) if not g]
    assert not stuck, f"{len(stuck)} states cannot reach quiescence fairly, e.g. {stuck[0]}"
    return Result(len(states), transitions, frozenset(sizes), stragglers)
