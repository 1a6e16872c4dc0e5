"""Exhaustive exploration of the round protocol (`elastic.recovery.rendezvous.step`) in memory.

Every participant is a program over the protocol's own state machine: it trains in a generation, and
joins the next round when its generation is broken (a peer crashed, left or went on), when `pending()`
says so, or once spuriously; it may announce, leave or finish. Each transition is ONE store operation of
one participant (or a fault), so the search covers every interleaving of their operations. Heartbeats are
an oracle: truthful (a crashed participant is dead) or, within a budget, wrong about a live participant
(a hung or GIL-stalled one that looks dead).

Two events of a cluster, as docs/rendezvous.md ("Store restarts", "Pairs that cannot connect") and its
SPIN model have them:

- the store restarted EMPTY (a budget of `restarts`): every key gone at once. Each live participant
  then reconnects (the first thing it does: its connection broke), and re-seeds with
  `elastic.recovery.rendezvous.reseed`, one operation a step, as its heartbeat thread does, interleaved
  with everything else: a join in progress stops at once (`Rendezvous._retry` raises `_Replaced`
  whichever thread found the restart), never running a step of the old join in the new store, and
  starts again once the re-seed is done (its first event then follows its re-posted evidence). The
  timing assumption is the SPIN model's: a quiet last call,
  and a judgement by a participant that found the store restarted, happen only once every live member of
  a generation has re-seeded (`settled`);
- a pair of live participants that cannot connect (`cut`, set and healed within budgets): a generation
  holding both is broken; each end may report the pair (``xa|b``, `Rendezvous.unreachable`) to the next
  round, and the end that `largest_reachable` leaves out of its generation's members waits outside until
  the link heals or its peer is gone (`Links.wait`), then joins again; a restarted store gets the report
  again with the re-seed.

Checked in every reachable state: one membership per generation, agreed by every participant that ever
held one (whatever store life told it); every member of a decision joined its round; no decision holds
a pair reported to its round; no split brain (of two generations training, one is broken or pending);
and from every state a fair path to quiescence. Used by tests/recovery/test_rendezvous.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Iterator

import attrs

import elastic.recovery.rendezvous as rendezvous
from elastic.recovery.partition import largest_reachable
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
    # new | idle (training in `gen`) | joining | outside (left out by a cut pair) | crashed | left |
    # finished | none (got None)
    status: str
    gen: int = -1
    members: tuple[str, ...] = ()  # generation `gen`'s members, as this participant holds them
    joiner: Joiner | None = None
    history: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (generation, its members) it trained in
    spurious: int = 0  # spurious regroups left (a collective failing for no visible reason)
    started_after_finish: bool = False
    life: int = 0  # the store's life its connection belongs to (`State.life`: the store's now)
    reseed: int | None = None  # the next operation of its re-seed (`rendezvous.reseed`), None: none
    replaced: bool = False  # its join must start again: the store restarted under it
    restarted: bool = False  # it found the store restarted (`Rendezvous._restarted_at`)
    stale: bool = False  # its generation was re-decided without it (the re-seed found another list)
    evidence: str = ""  # the ``xa|b,`` tokens it reported to round gen+1


@attrs.frozen
class State:
    store: tuple[tuple[str, bytes], ...]
    workers: tuple[Worker, ...]
    crashes: int  # crashes left
    suspicions: int  # wrong heartbeat judgements left
    leaves: int
    finishes: int
    restarts: int = 0  # store restarts left
    life: int = 0  # how many times the store restarted
    cut: bool = False  # the pair `Config.cut` cannot connect now
    cuts: int = 0
    heals: int = 0


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
    who_regroups: tuple[str, ...] = ()  # who has the `spurious` regroups (empty: everybody)
    restarts: int = 0  # times the store may restart empty
    late: tuple[str, ...] = ()  # newcomers that start only once the store restarted (they find it empty)
    cut: tuple[str, ...] = ()  # a pair that may be unable to connect (both reach the store)
    cuts: int = 0
    heals: int = 0

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
                members=cfg.initial if member else (),
                history=((0, cfg.initial),) if member else (),
                spurious=cfg.spurious if not cfg.who_regroups or name in cfg.who_regroups else 0,
            )
        )
    return State(
        store.frozen(),
        tuple(workers),
        cfg.crashes,
        cfg.suspicions,
        cfg.leaves,
        cfg.finishes,
        restarts=cfg.restarts,
        cuts=cfg.cuts,
        heals=cfg.heals,
    )


LIVE = ("idle", "joining", "outside")


def settled(state: State) -> bool:
    """The timing assumption: every live member of a generation re-seeded the store's present life (a
    quiet last call outlasts the re-seeds; trivially true before any restart)."""
    return all(
        w.life == state.life and w.reseed is None for w in state.workers if w.status in LIVE and w.gen >= 0
    )


def cut_holds(state: State, cfg: Config, members: tuple[str, ...]) -> bool:
    return state.cut and all(p in members for p in cfg.cut)


def broken(state: State, cfg: Config, w: Worker) -> bool:
    """Would a collective of `w`'s generation fail? (a member crashed, left or is elsewhere, or the cut
    pair is in it)"""
    by_name = {x.name: x for x in state.workers}
    if cut_holds(state, cfg, w.members):
        return True  # its group cannot form, or goes silent
    for m in w.members:
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
    yield from _environment(state, cfg)
    for i, w in enumerate(state.workers):
        store = MemStore(state.store)

        def put(nw: Worker, st: MemStore, i: int = i, **changes: int) -> State:
            workers = list(state.workers)
            if nw.status not in ("new", *LIVE):
                nw = Worker(nw.name, nw.status, history=nw.history)
            workers[i] = nw
            return attrs.evolve(state, store=st.frozen(), workers=tuple(workers), **changes)

        if w.status in ("new", *LIVE) and state.crashes > 0 and w.name in cfg.crashers(w.name):
            yield (
                f"{w.name} crashes",
                put(attrs.evolve(w, status="crashed"), store, crashes=state.crashes - 1),
                False,
            )
        if w.status in LIVE and w.life < state.life:
            # its connection broke with the store: it reconnects (a new client), finds another epoch and
            # starts re-seeding; a join in progress must start again
            nw = attrs.evolve(
                w,
                life=state.life,
                restarted=True,
                reseed=0 if w.gen >= 0 else None,
                replaced=w.status == "joining",
            )
            yield f"{w.name} reconnects", put(nw, store), True
            continue
        if w.reseed is not None:  # its re-seed, one operation a step, beside whatever else it does
            st = MemStore(state.store)
            k, stale = rendezvous.reseed(st, w.name, w.gen, w.members, w.evidence, w.reseed)
            nw = attrs.evolve(w, reseed=k, stale=w.stale or stale)
            yield f"{w.name} re-seeds ({w.reseed})", put(nw, st), True
        if w.status == "new":
            if w.name in cfg.late and state.life == 0:
                continue
            finished = store.check([FINISHED])
            nw = attrs.evolve(
                w,
                status="joining",
                joiner=start(w.name, -1),
                started_after_finish=finished,
                life=state.life,
            )
            yield f"{w.name} starts", put(nw, store), True
        elif w.status == "idle":
            yield from _trainer(state, cfg, w, put)
        elif w.status == "outside":
            # `Links.wait`: back once the link healed, its peer is gone, or the run finished
            peer = next(p for p in cfg.cut if p != w.name)
            gone = next(x for x in state.workers if x.name == peer).status not in LIVE
            if not state.cut or gone or store.check([FINISHED]):
                nw = attrs.evolve(w, status="joining", joiner=start(w.name, w.gen, w.members))
                yield f"{w.name} rejoins from outside", put(nw, store), True
        elif w.status == "joining" and w.replaced:
            if w.reseed is None:  # its join starts again once its re-seed is done (`Rendezvous.join`)
                nw = attrs.evolve(w, replaced=False, joiner=start(w.name, w.gen, w.members))
                yield f"{w.name} starts its join again", put(nw, store), True
        elif w.status == "joining":
            yield from _joiner(state, cfg, w, put)


def _environment(state: State, cfg: Config) -> Iterator[tuple[str, State, bool]]:
    """The faults of the cluster: the store restarted empty, the pair cut, the cut healed."""
    if state.restarts > 0:
        yield (
            "the store restarts empty",
            attrs.evolve(state, store=(), restarts=state.restarts - 1, life=state.life + 1),
            False,
        )
    if cfg.cut and not state.cut and state.cuts > 0:
        yield f"{'|'.join(cfg.cut)} cannot connect", attrs.evolve(state, cut=True, cuts=state.cuts - 1), False
    if state.cut and state.heals > 0:
        yield "the link heals", attrs.evolve(state, cut=False, heals=state.heals - 1), False


def _trainer(
    state: State, cfg: Config, w: Worker, put: Callable[..., State]
) -> Iterator[tuple[str, State, bool]]:
    """A member training in its generation: regroups (announcing it or not), reports the cut pair, leaves,
    finishes."""
    store = MemStore(state.store)
    finished = store.check([FINISHED])
    must = broken(state, cfg, w) or w.stale or pending(store, w.gen, w.members, cfg)
    end = cut_holds(state, cfg, w.members) and w.name in cfg.cut  # it finds the cut: it reports it
    if (must or w.spurious > 0) and not end:
        nw = attrs.evolve(
            w,
            status="joining",
            joiner=start(w.name, w.gen, w.members),
            spurious=w.spurious - (0 if must else 1),
            started_after_finish=finished,
        )
        yield f"{w.name} regroups", put(nw, store), must
        if must:
            st = MemStore(state.store)
            add_event(st, w.gen + 1, f"~{w.name}")
            yield f"{w.name} announces and regroups", put(nw, st), True
    if end:
        # its group did not form (`_Run.check_links` finds the cut on both ends): it reports the pair
        # (`Rendezvous.unreachable`), then joins, or waits outside when the rule leaves it out of its
        # generation's members (`_Run.rejoin`)
        peer = next(p for p in cfg.cut if p != w.name)
        token = f"x{w.name}|{peer},"
        st = MemStore(state.store)
        add_event(st, w.gen + 1, token[:-1])
        pair = frozenset(cfg.cut)
        if w.name in largest_reachable(w.members, {pair}, prefer=w.members):
            nw = attrs.evolve(w, status="joining", joiner=start(w.name, w.gen, w.members), evidence=token)
        else:
            nw = attrs.evolve(w, status="outside", evidence=token)
        yield f"{w.name} reports {token[:-1]}", put(nw, st), True
    if state.leaves > 0:
        st = MemStore(state.store)
        add_event(st, w.gen + 1, f"-{w.name}")
        yield f"{w.name} leaves", put(attrs.evolve(w, status="left"), st, leaves=state.leaves - 1), False
    if state.finishes > 0 and not must:
        st = MemStore(state.store)
        st.set(FINISHED, str(w.gen))
        st.compare_set(decision_key(w.gen + 1), "", "!")
        ring(st, w.gen + 1)
        nw = attrs.evolve(w, status="finished")
        yield f"{w.name} finishes", put(nw, st, finishes=state.finishes - 1), False


def _joiner(
    state: State, cfg: Config, w: Worker, put: Callable[..., State]
) -> Iterator[tuple[str, State, bool]]:
    """One step of a join in progress."""
    j = w.joiner
    assert j is not None
    if j.phase not in ("count", "check", "fetch", "obsolete?"):
        st = MemStore(state.store)
        nj = step(j, st, _no_proposal)
        yield f"{w.name} {j.phase}", put(_advance(w, nj), st), True
        return
    events = parse_events(j.events)
    ok = settled(state)
    outcomes: set[Joiner] = set()
    for dead, costs in _oracles(state, w, j, events, cfg):
        for quiet in (True, False) if ok else (False,):
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

                if w.restarted and not ok:
                    return None  # `_restarted_at`: it waits a last call for the others' re-seed
                if orphan and not q:
                    return None
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
            yield label, put(_advance(w, nj), st, suspicions=state.suspicions - int(costs)), not costs


def _no_proposal(n: int, prev: tuple[str, ...], ev: Log, orphan: bool) -> tuple[str, ...] | None:
    msg = "propose called outside the judging phases"
    raise AssertionError(msg)


def _advance(w: Worker, j: Joiner) -> Worker:
    if j.phase != "done":
        return attrs.evolve(w, joiner=j)
    if j.finished:
        return attrs.evolve(w, status="none", joiner=None)
    return attrs.evolve(
        w,
        status="idle",
        gen=j.round,
        members=j.decision,
        joiner=None,
        history=(*w.history, (j.round, j.decision)),
        stale=False,
        evidence="",
    )


def _reseeded(store: MemStore, n: int) -> bool:
    """Is round n's decision a re-seed (``<p>;*;*;<digest>``: a restarted store, written by a member)?"""
    raw = peek(store, decision_key(n))
    return raw is not None and raw.decode().split(";")[1:2] == ["*"]


def _pending_of(state: State, store: MemStore, w: Worker, cfg: Config) -> bool:
    return w.stale or pending(store, w.gen, w.members, cfg)


def check_safety(state: State, cfg: Config) -> None:
    """The protocol's properties in one reachable state; AssertionError naming the violation."""
    store = MemStore(state.store)
    rounds = decided_rounds(store)
    for n in rounds:
        members = members_of(store, n)
        assert members, f"round {n}: decided, but its leader's list of members is missing"
        assert len(set(members)) == len(members), f"round {n}: a participant twice in {members}"
        assert cfg.min_workers <= len(members) <= cfg.max_workers, f"round {n}: size of {members}"
        events = events_of(store, n)
        if not _reseeded(store, n):  # a re-seeded decision was judged in an earlier life of the store
            joined = events.joined
            assert all(m in joined for m in members), f"round {n}: {members} did not all join: {joined}"
        for pair in events.unreachable:
            assert not pair <= set(members), (
                f"round {n}: {members} holds {sorted(pair)}, reported unreachable"
            )
        if n > 0 and state.life == 0:
            assert n - 1 in rounds, f"round {n} decided before round {n - 1}"
    # one membership per generation, agreed by every live participant that held one, whatever store
    # life told it (a participant that crashed is not asked: a restarted store may number a generation
    # of the survivors as one it had trained in before, with nobody left to disagree)
    held: dict[int, tuple[str, tuple[str, ...]]] = {}
    for w in state.workers:
        for g, members in w.history:
            assert w.name in members, f"{w.name} thinks it is in generation {g}: {members}"
            if w.status not in LIVE:
                continue
            other = held.setdefault(g, (w.name, members))
            assert other[1] == members, (
                f"generation {g}: {w.name} holds {list(members)}, {other[0]} holds {list(other[1])}"
            )
            if state.life == 0:  # the store's first life: what it holds is the store's decision
                assert members == members_of(store, g), (
                    f"{w.name} thinks it is in generation {g}: {members_of(store, g)}"
                )
        gens = [g for g, _ in w.history]
        assert gens == sorted(set(gens)), f"{w.name}: generations not increasing {gens}"
        if w.status == "idle":
            assert gens and gens[-1] == w.gen
            # at most one generation training: an older generation is told to end
            newer = [n for n in rounds if n > w.gen]
            if newer and w.life == state.life and w.reseed is None:
                assert _pending_of(state, store, w, cfg), (
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
    # no split brain: of two generations training (another number or another list), one is told to end
    trainers = [w for w in state.workers if w.status == "idle"]
    for u in trainers:
        for v in trainers:
            if (u.gen, u.members) < (v.gen, v.members):
                assert any(broken(state, cfg, x) or _pending_of(state, store, x, cfg) for x in (u, v)), (
                    f"split brain: {u.name} trains generation {u.gen} {list(u.members)} and {v.name} "
                    f"generation {v.gen} {list(v.members)}, neither broken nor pending"
                )


def goal(state: State, cfg: Config) -> bool:
    """Quiescence: every live trainer in the latest generation, with all its members, and nobody joining
    but spares (the generation has `max_workers`) or workers that cannot reach `min_workers`; nobody
    reconnecting or re-seeding; outside only the side the cut pair leaves out, while the cut lasts."""
    if any(w.status == "new" and not (w.name in cfg.late and state.life == 0) for w in state.workers):
        return False  # (a late newcomer comes only with a restart, which may never happen)
    live = [w for w in state.workers if w.status in LIVE]
    if any(w.life != state.life or w.reseed is not None or w.replaced for w in live):
        return False
    store = MemStore(state.store)
    for w in state.workers:
        if w.status == "outside":
            peer = next(p for p in cfg.cut if p != w.name)
            if not state.cut or next(x for x in state.workers if x.name == peer).status not in LIVE:
                return False
    joining = [w for w in state.workers if w.status == "joining"]
    if store.check([FINISHED]):
        return not joining
    trainers = [w for w in state.workers if w.status == "idle"]
    if trainers:
        latest = max(decided_rounds(store), default=-1)
        members = members_of(store, latest)
        if not (all(w.gen == latest for w in trainers) and set(members) == {w.name for w in trainers}):
            return False
        if cut_holds(state, cfg, members):
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


def _trace(states: list[State], parents: list[tuple[int, str]], i: int) -> str:
    """The transitions that first reached state i, one a line."""
    labels = []
    while parents[i][0] >= 0:
        i, label = parents[i]
        labels.append(label)
    return "\n".join(f"  {label}" for label in reversed(labels))


def _explore(cfg: Config, limit: int) -> Result:
    init = initial_state(cfg)
    index: dict[State, int] = {init: 0}
    states = [init]
    parents: list[tuple[int, str]] = [(-1, "")]  # how each state was first reached (for a trace)
    fair_preds: list[list[int]] = [[]]
    queue = deque([0])
    transitions = 0
    sizes: set[tuple[int, int]] = set()
    stragglers = 0
    while queue:
        si = queue.popleft()
        s = states[si]
        try:
            check_safety(s, cfg)
        except AssertionError as exc:
            msg = f"{exc}\nreached by:\n{_trace(states, parents, si)}"
            raise AssertionError(msg) from None
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
                parents.append((si, _label))
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
    stuck = [i for i, g in enumerate(good) if not g]
    if stuck:
        first = min(stuck)  # the one reached first: the shortest trace
        msg = (
            f"{len(stuck)} states cannot reach quiescence fairly, e.g. {states[first]}\nreached by:\n"
            f"{_trace(states, parents, first)}"
        )
        raise AssertionError(msg)
    return Result(len(states), transitions, frozenset(sizes), stragglers)
