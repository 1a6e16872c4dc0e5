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
from elastic.recovery.rendezvous import FINISHED, Joiner, Log, decide, log_key, pending_from, start, step


def parse_log(raw: bytes) -> Log:
    return rendezvous.parse_log(raw)


class MemStore:
    """The store operations of `elastic.recovery.rendezvous.Ops` on a dict, with TCPStore's semantics."""

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

    def append(self, key: str, value: str) -> None:
        self.data[key] = self.data.get(key, b"") + value.encode()

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        current = self.data.get(key)
        if (current is None and expected_value == "") or current == expected_value.encode():
            self.data[key] = desired_value.encode()
        elif current is None:
            return expected_value.encode()
        return self.data[key]


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


def initial_state(cfg: Config) -> State:
    store = MemStore()
    workers = []
    if cfg.initial:
        store.append(log_key(0), "".join(f"+{p}," for p in cfg.initial) + "=" + "|".join(cfg.initial) + ",")
        store.set("next", "1")
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


def canonical(store: MemStore) -> tuple[tuple[str, bytes], ...]:
    """The store with every round's log rewritten in one canonical order of its tokens.

    Sound for the search because the protocol reads a log only through `parse_log`, and the rewrite
    keeps what `parse_log` sees (joins in order of first join, the first proposal) and what the checks
    see (who joined before the decision); it merges states that differ only in the order of announce
    and leave tokens, or in proposals after the first.
    """
    items = []
    for key, raw in sorted(store.data.items()):
        if key.startswith("r/"):
            raw = _canonical_log(raw.decode()).encode()
        items.append((key, raw))
    return tuple(items)


@functools.cache
def _canonical_log(text: str) -> str:
    parts: list[tuple[dict[str, None], set[str], set[str]]] = [({}, set(), set()), ({}, set(), set())]
    decision = None
    finished = False
    for token in text.split(","):
        kind, name = token[:1], token[1:]
        joined, announced, left = parts[0 if decision is None else 1]
        if kind == "+":
            if name not in parts[0][0]:
                joined.setdefault(name, None)
        elif kind == "~":
            announced.add(name)
        elif kind == "-":
            left.add(name)
        elif kind == "=" and decision is None:
            decision = name
        elif kind == "!":
            finished = True
    out = []
    for index, (joined, announced, left) in enumerate(parts):
        out += [f"+{p}," for p in joined]
        out += [f"~{p}," for p in sorted(announced - (parts[0][1] if index else set()))]
        out += [f"-{p}," for p in sorted(left - (parts[0][2] if index else set()))]
        if index == 0 and decision is not None:
            out.append(f"={decision},")
    if finished:
        out.append("!,")
    return "".join(out)


def members_of(store: MemStore, n: int) -> tuple[str, ...]:
    return parse_log(store.data.get(log_key(n), b"")).decision or ()


def decided_rounds(store: MemStore) -> list[int]:
    return sorted(int(k[2:]) for k, v in store.data.items() if k.startswith("r/") and b"=" in v)


def pending(store: MemStore, gen: int, members: tuple[str, ...], cfg: Config) -> bool:
    """What the heartbeat thread of a member of `gen` computes (`Rendezvous._beat_once`)."""
    return pending_from(store.data.get(log_key(gen + 1), b""), members, cfg.max_workers)


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
    """(participants judged dead, whether this costs a suspicion) for one `poll` step."""
    crashed = frozenset(x.name for x in state.workers if x.status == "crashed")
    yield crashed, False
    if state.suspicions > 0:
        live_others = sorted({p for p in (*j.prev, *events.joined) if p != w.name and p not in crashed})
        for p in live_others:
            yield crashed | {p}, True


def successors(state: State, cfg: Config) -> Iterator[tuple[str, State, bool]]:
    """(label, next state, fair) for every transition; `fair`: truthful oracle and no fault."""
    for i, w in enumerate(state.workers):
        store = MemStore(state.store)

        def put(nw: Worker, st: MemStore, i: int = i, **changes: int) -> State:
            workers = list(state.workers)
            workers[i] = nw if nw.status in ("new", "idle", "joining") else Worker(nw.name, nw.status)
            return attrs.evolve(state, store=canonical(st), workers=tuple(workers), **changes)

        if w.status in ("new", "idle", "joining") and state.crashes > 0:
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
                    joiner=start(w.name, w.gen),
                    spurious=w.spurious - (0 if must else 1),
                    started_after_finish=finished,
                )
                yield f"{w.name} regroups", put(nw, store), must
                if must:
                    st = MemStore(state.store)
                    st.append(log_key(w.gen + 1), f"~{w.name},")
                    yield f"{w.name} announces and regroups", put(nw, st), True
            if state.leaves > 0:
                st = MemStore(state.store)
                st.append(log_key(w.gen + 1), f"-{w.name},")
                yield (
                    f"{w.name} leaves",
                    put(attrs.evolve(w, status="left"), st, leaves=state.leaves - 1),
                    False,
                )
            if state.finishes > 0 and not must:
                st = MemStore(state.store)
                st.set(FINISHED, str(w.gen))
                st.append(log_key(w.gen + 1), "!,")
                nw = attrs.evolve(w, status="finished")
                yield f"{w.name} finishes", put(nw, st, finishes=state.finishes - 1), False
        elif w.status == "joining":
            j = w.joiner
            assert j is not None
            events = parse_log(store.data.get(log_key(j.round), b""))
            if j.phase == "poll" and events.decision is None and not events.finished:
                for dead, costs in _oracles(state, w, j, events, cfg):
                    outcomes: set[tuple[str, ...] | None] = set()
                    for quiet in (True, False):
                        st = MemStore(state.store)

                        def propose(
                            n: int,
                            prev: tuple[str, ...],
                            ev: Log,
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

                        nj = step(j, st, propose)
                        outcome = nj.proposal if nj.phase == "propose" else None
                        if outcome in outcomes:
                            continue
                        outcomes.add(outcome)
                        label = f"{w.name} polls dead={sorted(dead)} quiet={quiet}"
                        yield (
                            label,
                            put(_advance(w, nj), st, suspicions=state.suspicions - int(costs)),
                            not costs,
                        )
            else:
                st = MemStore(state.store)
                nj = step(j, st, _no_proposal)
                yield f"{w.name} {j.phase}", put(_advance(w, nj), st), True


def _no_proposal(n: int, prev: tuple[str, ...], ev: Log) -> tuple[str, ...] | None:
    msg = "propose called outside the events phase"
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
        raw = store.data.get(log_key(n), b"").decode()
        decision_at = raw.index("=")
        assert len(set(members)) == len(members), f"round {n}: a participant twice in {members}"
        assert cfg.min_workers <= len(members) <= cfg.max_workers, f"round {n}: size of {members}"
        joined_before = raw[:decision_at]
        assert all(f"+{m}," in joined_before for m in members), (
            f"round {n}: {members} did not all join: {raw}"
        )
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
    """`parse_log` memoized while exploring (it is pure; the search parses the same logs again and again)."""
    original = rendezvous.parse_log
    rendezvous.parse_log = functools.lru_cache(maxsize=None)(original)  # type: ignore[assignment]
    try:
        yield
    finally:
        rendezvous.parse_log = original  # type: ignore[assignment]


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
