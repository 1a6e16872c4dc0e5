"""`elastic.run` and `World`: survivors keep their state and re-form the group, losing at most one step.

The scenarios run real worker processes (CPU, gloo) under ``elastic.spawn(..., restart="worker")``; each
spawn plays several failures in a row, injected by `fail_at`-style events keyed on (slot, life in the
slot, step, the sizes the world has had). Every worker trains the same toy step, ``w += step + 1``
averaged over an all-reduce, so the weights after ``n`` steps are exactly ``n (n + 1) / 2``: a step lost
and redone leaves them right, a step applied twice or a stale state that won would not.

The state records the sequence of world sizes (`sizes`, appended at each generation start when it
changes): it is synced with the rest of the state, so every member decides the same way when to inject
the next event and when to stop.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist

import elastic
from elastic.recovery import run as _run
from elastic.recovery.store import format_address, serve

pytestmark = pytest.mark.skipif(not Path("/proc/self").exists(), reason="the scenarios read /proc")


@elastic.elastic_state(tenure=lambda s: s.step)
@attrs.define
class Toy:
    w: torch.Tensor
    step: int = 0
    sizes: list = attrs.field(factory=list)


def expected_w(steps: int) -> float:
    return steps * (steps + 1) / 2


# --------------------------------------------------------------------------------------------------------
# Worker side


@attrs.define
class Event:
    """`what` happens to (slot, life) before the step `step` or later, once the world sizes are `sizes`."""

    slot: int
    life: int
    step: int
    what: str  # "kill" (SIGKILL), "raise", "hang" (SIGSTOP, SIGCONT after `seconds`), "sigterm"
    sizes: list[int] | None = None  # phase(state) must equal this (None: any)
    recovered: int | None = None  # or: the world is complete and came back this many times
    seconds: float = 0.0


def phase(state: Toy, full: int) -> list[int]:
    """The world sizes since the world was first complete (a slow starter may miss the first round)."""
    return state.sizes[state.sizes.index(full) :] if full in state.sizes else []


def recoveries(state: Toy, full: int) -> int:
    """How many times the world came back to `full` workers after being smaller."""
    sizes = phase(state, full)
    return sum(1 for a, b in itertools.pairwise(sizes) if a < full and b == full)


def fail_at(events: list[Event], state: Toy, fired: set[int]) -> None:
    """Fire the first event due on this worker (at most once per process)."""
    slot = int(os.environ["ELASTIC_SLOT"])
    life = int(os.environ["ELASTIC_SLOT_RESTARTS"])
    for i, ev in enumerate(events):
        if i in fired or (ev.slot, ev.life) != (slot, life) or state.step < ev.step:
            continue
        if ev.sizes is not None and phase(state, ev.sizes[0]) != ev.sizes:
            continue
        if ev.recovered is not None and (state.sizes[-1] != 3 or recoveries(state, 3) != ev.recovered):
            continue
        fired.add(i)
        if ev.what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif ev.what == "raise":
            msg = f"injected failure at step {state.step}"
            raise ValueError(msg)
        elif ev.what == "hang":
            subprocess.Popen(["sh", "-c", f"sleep {ev.seconds}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        elif ev.what == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _train(state: Toy, world: Any, ctx: dict[str, Any]) -> dict[str, Any]:
    rec = ctx["record"]
    if not state.sizes or state.sizes[-1] != world.size:
        state.sizes.append(world.size)
    rec["gens"].append(
        {
            "generation": world.generation,
            "size": world.size,
            "rank": world.rank,
            "step": state.step,
            "id": id(state.w),
            "ptr": state.w.data_ptr(),
            "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")),
            "rss": rss_kib(),
        }
    )
    done = ctx["done"]
    while not done(state, world):
        if state.step > 5000:
            msg = f"scenario never finished: sizes {state.sizes}"
            raise AssertionError(msg)
        world.check()
        fail_at(ctx["events"], state, ctx["fired"])
        g = torch.full((4,), float(state.step + 1))
        dist.all_reduce(g)
        state.w.add_(g / world.size)
        rec["steps"].append(state.step)
        state.step += 1
        if ctx.get("ckpt") and state.step % 5 == 0:
            elastic.save(state, ctx["ckpt"])
        time.sleep(0.01)
    elastic.verify(state)
    rec["final"] = (state.step, state.w.tolist(), list(state.sizes))
    return rec


def worker(tmp: str, scenario: str, events: list[Event], timeout: float) -> Any:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    slot = int(os.environ["ELASTIC_SLOT"])
    life = int(os.environ["ELASTIC_SLOT_RESTARTS"])
    state = Toy(w=torch.zeros(4))
    record: dict[str, Any] = {"slot": slot, "life": life, "gens": [], "steps": []}
    ctx: dict[str, Any] = {"record": record, "events": events, "fired": set(), "tmp": tmp}
    ckpt = None
    if scenario == "kill":
        ctx["done"] = lambda s, w: s.step >= 30 and phase(s, 3)[:2] == [3, 2] and w.size == 3
        if slot == 2 and life == 1:  # the first replacement dies in the sync that starts its generation
            os.environ["ELASTIC_FAULT"] = "0:objects:die,1:objects:die,2:objects:die"
    elif scenario == "hang":
        ctx["done"] = lambda s, w: s.step >= 60 and recoveries(s, 3) >= 2 and w.size == 2
    elif scenario == "all":
        ckpt = str(Path(tmp) / "ckpt")
        ctx["ckpt"] = ckpt
        ctx["done"] = lambda s, w: s.step >= 20
    elif scenario == "churn":
        return churn(state, record, ctx, timeout)
    try:
        return _run.run(lambda s, w: _train(s, w, ctx), state, ckpt=ckpt, timeout=timeout)
    except BaseException as exc:
        (Path(tmp) / f"raised-{slot}-{life}").write_text(f"{type(exc).__name__}: {exc}")
        raise


CYCLES = 6


def churn(state: Toy, record: dict[str, Any], ctx: dict[str, Any], timeout: float) -> Any:
    """Slots 0 and 1 train; slot 2 joins, trains 2 steps, leaves by SIGTERM, and joins again, CYCLES times."""
    slot = int(os.environ["ELASTIC_SLOT"])
    flag = Path(ctx["tmp"]) / "churn-done"

    def done(s: Toy, w: Any) -> bool:  # collective: every rank decides alike
        t = torch.tensor([int(flag.exists())])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item()) and w.size == 2

    ctx["done"] = done
    if slot != 2:
        return _run.run(lambda s, w: _train(s, w, ctx), state, timeout=timeout)
    record["after"] = []

    def visit(s: Toy, w: Any) -> None:
        record["gens"].append({"generation": w.generation, "size": w.size, "step": s.step, "id": id(s.w)})
        start = s.step
        if not s.sizes or s.sizes[-1] != w.size:
            s.sizes.append(w.size)
        while not done(s, w):  # the same collectives as the others' loop, in the same order
            w.check()
            if s.step == start + 2:
                os.kill(os.getpid(), signal.SIGTERM)  # leave at the next check(), with the others
            g = torch.full((4,), float(s.step + 1))
            dist.all_reduce(g)
            s.w.add_(g / w.size)
            s.step += 1
            time.sleep(0.01)

    for _ in range(CYCLES):
        out = _run.run(visit, state, timeout=timeout)
        assert out is None
        record["after"].append((threading.active_count(), len(os.listdir("/proc/self/fd")), rss_kib()))
    flag.write_text("done")
    return record


# --------------------------------------------------------------------------------------------------------
# Checks


def check_survivor(rec: dict[str, Any], failures: int) -> None:
    """Tensors kept in place across generations, and at most one step redone per failure."""
    assert len({g["id"] for g in rec["gens"]}) == 1, rec["gens"]
    assert len({g["ptr"] for g in rec["gens"]}) == 1, rec["gens"]
    steps = rec["steps"]
    redone = len(steps) - len(set(steps))
    assert redone <= failures, steps
    for a, b in itertools.pairwise(steps):
        assert b == a + 1 or b == a, (a, b)  # never a step skipped, at most the one in flight again


def check_final(results: list[Any], slots: list[int]) -> int:
    finals = {results[s]["final"][0] for s in slots}
    assert len(finals) == 1, finals
    (steps,) = finals
    for s in slots:
        assert results[s]["final"][1] == [expected_w(steps)] * 4
    return steps


def test_killed_worker_then_a_replacement_killed_in_its_first_sync(tmp_path: Path, capfd: Any) -> None:
    events = [Event(slot=2, life=0, step=10, what="kill", sizes=[3])]
    results = elastic.spawn(
        worker, 3, args=(str(tmp_path), "kill", events, 20.0), restart="worker", max_restarts=2, timeout=110
    )
    captured = capfd.readouterr()
    out = captured.out + captured.err
    check_final(results, [0, 1, 2])
    for s in (0, 1):
        assert results[s]["life"] == 0
        check_survivor(results[s], failures=2)
        sizes = [g["size"] for g in results[s]["gens"]]
        assert 2 in sizes[sizes.index(3) :] and sizes[-1] == 3
    joiner = results[2]
    assert joiner["life"] == 2  # life 1 died in its first sync (ELASTIC_FAULT), life 2 made it
    assert joiner["gens"][0]["step"] >= 10  # received the survivors' state
    assert all(s >= joiner["gens"][0]["step"] for s in joiner["steps"])
    assert "restarting slot 2 (restart 1 of 2)" in out
    assert "restarting slot 2 (restart 2 of 2)" in out
    assert "communication failed" in out


def test_hung_worker_rejoins_a_raising_worker_restarts_a_sigterm_leaves(tmp_path: Path) -> None:
    events = [
        Event(slot=1, life=0, step=8, what="hang", sizes=[3], seconds=9),
        Event(slot=2, life=0, step=25, what="raise", recovered=1),
        Event(slot=0, life=0, step=45, what="sigterm", recovered=2),
    ]
    # timeout=60: the survivors block in the hung worker's all-reduce; only the watch (its heartbeat
    # expired) ends that collective within the 9 s it is stopped, so that they train on without it
    results = elastic.spawn(
        worker, 3, args=(str(tmp_path), "hang", events, 60.0), restart="worker", max_restarts=1, timeout=110
    )
    assert results[0] is None  # SIGTERM: run returned None there
    raised = (tmp_path / "raised-2-0").read_text()
    assert raised.startswith("ValueError: injected failure at step ")
    assert int(raised.split("step ")[1].split()[0]) >= 25
    steps = check_final(results, [1, 2])
    assert recoveries(Toy(w=torch.zeros(1), sizes=results[1]["final"][2]), 3) == 2
    hung = results[1]
    assert hung["life"] == 0  # the hung worker was never restarted: it woke and rejoined
    # its own steps stop at 8, then it received the survivors' (newer) state as a newcomer
    stale = hung["steps"].index(7)  # it stopped before step 8's all-reduce
    after = hung["steps"][stale + 1]
    assert after > 8 + 10, hung["steps"][stale - 1 : stale + 3]
    assert next(g for g in hung["gens"] if g["step"] > 8)["step"] == after
    assert len({g["ptr"] for g in hung["gens"]}) == 1  # received in place
    replacement = results[2]
    assert replacement["life"] == 1
    # the departure cost nothing: from the SIGTERM on, no survivor ran a step twice, none was skipped
    tails = [[s for s in results[r]["steps"] if s >= 45] for r in (1, 2)]
    for tail in tails:
        assert tail == sorted(set(tail)), tail
    start = min(t[0] for t in tails if t)
    assert sorted(set(tails[0]) | set(tails[1])) == list(range(start, steps))


def test_every_worker_dies_and_the_checkpoint_brings_the_state_back(tmp_path: Path) -> None:
    events = [Event(slot=0, life=0, step=12, what="kill"), Event(slot=1, life=0, step=12, what="kill")]
    results = elastic.spawn(
        worker, 2, args=(str(tmp_path), "all", events, 20.0), restart="worker", max_restarts=1, timeout=110
    )
    check_final(results, [0, 1])
    for rec in results:
        assert rec["life"] == 1
        assert rec["gens"][0]["step"] == 10  # the checkpoint of step 10, not a fresh start
        assert rec["final"][0] == 20


def test_repeated_generations_leak_no_threads_fds_or_memory_and_joins_cost_no_step(tmp_path: Path) -> None:
    results = elastic.spawn(
        worker, 3, args=(str(tmp_path), "churn", [], 20.0), restart="worker", max_restarts=0, timeout=110
    )
    churner = results[2]
    assert len(churner["after"]) == CYCLES
    threads, fds, rss = zip(*churner["after"])
    assert threads[-1] <= threads[1], threads  # run() stops its heartbeat thread every time
    assert fds[-1] <= fds[1], fds
    assert rss[-1] - rss[1] < 20_000, rss  # KiB
    assert len({g["id"] for g in churner["gens"]}) == 1
    check_final(results, [0, 1])
    for s in (0, 1):
        rec = results[s]
        # joins and departures cost no step (a slow starter may have received a few steps first)
        assert rec["steps"] == list(range(rec["steps"][0], rec["final"][0]))
        gens = rec["gens"]
        assert len(gens) >= CYCLES + 1
        late = gens[3:]  # a leak grows with every generation; a thread or socket still closing does not
        assert late[-1]["threads"] - min(g["threads"] for g in late) <= 2, [g["threads"] for g in gens]
        assert late[-1]["fds"] - min(g["fds"] for g in late) <= 2, [g["fds"] for g in gens]
        assert late[-1]["rss"] - late[0]["rss"] < 20_000
        check_survivor(rec, failures=0)


# --------------------------------------------------------------------------------------------------------
# In-process unit tests (no worker processes)


class FakeRendezvous:
    def __init__(self, alive: set[str], pending: bool = False) -> None:
        self._alive = alive
        self._pending = pending
        self.progressed = 0
        self.pending_calls = 0
        self.left = False
        self.expiry = 0.02

    def progress(self) -> None:
        self.progressed += 1

    def pending(self) -> bool:
        self.pending_calls += 1
        return self._pending

    def alive(self) -> set[str]:
        return set(self._alive)

    def leave(self) -> None:
        self.left = True


def make_world(rdzv: Any, **overrides: Any) -> Any:
    """A `World` of one rank (generation 0, flag every check, 5 s timeout) unless `overrides` say else."""
    options: dict[str, Any] = {
        "rank": 0,
        "size": 1,
        "generation": 0,
        "group": None,
        "check_every": 1,
        "leave_requested": lambda: False,
        "timeout": timedelta(seconds=5),
    }
    options.update(overrides)
    return _run.World(rdzv=rdzv, **options)


@attrs.frozen
class FakeMembership:
    generation: int = 3
    rank: int = 0
    size: int = 2
    members: tuple[str, ...] = ("a", "b")
    prefix: str = "elastic/test/pg/3/"


@pytest.fixture
def single_group() -> Any:
    """A default gloo group of one rank on a fresh store prefix, destroyed afterwards."""
    store = dist.HashStore()
    group = _run._new_group(store, FakeMembership(size=1, members=("a",)), "gloo", timedelta(seconds=10))
    yield group
    _run._end_group(abort=False)


def test_a_failed_init_leaves_the_group_counter_and_excepthook_as_they_were() -> None:
    from torch.distributed.distributed_c10d import _world

    hook = sys.excepthook
    store = dist.HashStore()
    try:
        # a peer that never comes: torch's own init_process_group fails and leaves its counter at 1
        with pytest.raises(RuntimeError):
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("raw", store),
                rank=0,
                world_size=2,
                timeout=timedelta(seconds=0.3),
            )
        assert _world.group_count == 1
        sys.excepthook = hook
        with pytest.raises(RuntimeError):  # the same through _new_group: the counter is back at 0
            _run._new_group(store, FakeMembership(prefix="p1/"), "gloo", timedelta(seconds=0.3))
        assert _world.group_count == 0
        assert sys.excepthook is hook
        _world.group_count = 7  # whatever failed before, the next group gets the name every rank gives it
        one = FakeMembership(size=1, members=("a",), prefix="p2/")
        _run._new_group(store, one, "gloo", timedelta(seconds=10))
        assert dist.group.WORLD.group_name == "0"
        assert sys.excepthook is hook
    finally:
        _run._end_group(abort=False)
        sys.excepthook = hook


def _judge(exc: BaseException, rdzv: Any, gen: Any, probe: float = 5.0) -> str:
    gen.record(_run.where_of(exc))
    return _run._judge(exc, rdzv, gen, probe, timedelta(seconds=5))


def test_a_failure_is_a_peers_only_with_evidence_and_different_places_are_the_scripts() -> None:
    timed_out = RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    healthy = FakeRendezvous({"a", "b"})

    def pair() -> tuple[Any, Any]:
        store = dist.HashStore()
        return _run._Generation(store, FakeMembership()), _run._Generation(store, FakeMembership(rank=1))

    # every member present, one place for all (nobody gone): nobody's failure, the exception propagates
    gen, peer = pair()
    peer.record(_run.IN_FN)
    assert _judge(RuntimeError("plain bug"), healthy, gen) == _run.OWN
    assert peer.verdict(None) == _run.OWN  # written for the others: everyone adopts the first verdict
    # a member that records nothing and has no failure of its own after the probe: it was elsewhere
    gen, peer = pair()
    started = time.monotonic()
    verdict = _judge(timed_out, healthy, gen, probe=0.2)
    assert time.monotonic() - started >= 0.2  # it waited for the member for the whole probe
    assert verdict.startswith(_run.MISMATCH)
    assert f"rank 0 in {_run.IN_FN}; rank 1 in {_run.RUNNING}" in verdict
    # rank 0 in save's election, rank 1 in DDP's all-reduce: the script's bug, named on every rank
    gen, peer = pair()
    peer.record(_run.IN_FN)
    saving = elastic.SyncError("save timed out in phase 'save-elect'", phase="save-elect", op="save")
    verdict = _judge(saving, healthy, gen)
    assert verdict.startswith(_run.MISMATCH)
    assert "rank 0 in save() (phase 'save-elect'); rank 1 in a collective of fn" in verdict
    assert "not on rank 0 only" in verdict
    # a member in world.busy() while this one waited in a collective
    gen, peer = pair()
    peer.note("world.busy('compile')")
    verdict = _judge(timed_out, healthy, gen)
    assert "rank 1 in world.busy('compile')" in verdict
    # a member whose heartbeat stopped and who records nothing: dead or hung
    gen, peer = pair()
    why = _judge(timed_out, FakeRendezvous({"a"}), gen)
    assert why == _run.REGROUP + "rank(s) [1] stopped heartbeating (dead or hung)"
    # ... but one that records where it was is alive, whatever its heartbeat said a moment ago
    gen, peer = pair()
    peer.record(_run.IN_FN)
    assert _judge(timed_out, FakeRendezvous({"a"}), gen) == _run.OWN
    # a member whose process exited (same host): at once
    gen, peer = pair()
    gone = FakeRendezvous({"a", "b"})
    gone.exited = lambda: {"b"}  # type: ignore[attr-defined]
    assert _judge(timed_out, gone, gen) == _run.REGROUP + "rank(s) [1] exited"
    # a member that left with its own exception
    gen, peer = pair()
    peer.announce("raised ValueError")
    wrapped = elastic.SyncError("sync failed in phase 'objects'", phase="objects", op="sync")
    assert _judge(wrapped, healthy, gen) == _run.REGROUP + "rank 1 left the generation (raised ValueError)"
    # a verdict written first by a peer is adopted as it is
    gen, peer = pair()
    peer.verdict(_run.REGROUP + "rank(s) [2] exited")
    assert _judge(timed_out, healthy, gen) == _run.REGROUP + "rank(s) [2] exited"
    # where a rank was, from its exception
    assert _run.where_of(ValueError("x")) == _run.IN_FN
    assert _run.where_of(saving) == "save() (phase 'save-elect')"
    tagged = RuntimeError("gloo")
    tagged._elastic_where = "world.check()"  # type: ignore[attr-defined]
    try:
        raise elastic.SyncError("outer") from tagged
    except elastic.SyncError as outer:
        assert _run.where_of(outer) == "world.check()"


def test_generations_failing_at_one_tenure_end_with_their_history() -> None:
    stalls = _run._Stalls(3)
    assert stalls.failed(0, 5, 5, "rank(s) [1] exited") is None
    assert stalls.failed(1, 5, 7, "rank(s) [1] exited") is None  # steps completed: no stall
    assert stalls.history == []
    assert stalls.failed(2, 7, 7, "a") is None
    assert stalls.failed(3, 7, 7, "b") is None
    err = stalls.failed(4, 7, 7, "c")
    assert isinstance(err, elastic.ElasticError)
    text = str(err)
    assert "3 generations in a row failed before a step completed, all at tenure 7" in text
    assert "generation 2: a\n  generation 3: b\n  generation 4: c" in text
    stalls = _run._Stalls(2)
    assert stalls.failed(0, 3, 3, "a") is None
    assert stalls.failed(1, 4, 4, "b") is None  # another tenure: counting starts again
    assert stalls.history == ["generation 1: b"]
    stalls.succeeded()
    assert stalls.history == []
    # a generation that failed in its own load or sync completed no step, whatever the tenure then
    assert stalls.failed(3, _run.NOT_STARTED, None, "x") is None
    assert stalls.history == ["generation 3: x"]
    assert isinstance(stalls.failed(4, _run.NOT_STARTED, None, "y"), elastic.ElasticError)
    stalls.succeeded()
    assert stalls.failed(2, [1], [1], "x") is None  # lists compare; incomparable tenures count nothing
    assert _run._Stalls(1).failed(0, float("nan"), float("nan"), "y") is None


def test_strip_frees_what_a_closure_in_the_traceback_holds_and_keeps_its_text() -> None:
    import gc
    import weakref

    class Module:  # stands for a module with hooks: torch calls its forward inside a closure over it
        pass

    def call(module: Module) -> None:
        def inner() -> None:
            assert module is not None
            raise RuntimeError("Connection closed by peer")

        inner()

    held = Module()
    alive = weakref.ref(held)
    try:
        call(held)
    except RuntimeError as exc:
        caught = exc
    del held
    gc.collect()
    assert alive() is not None  # the traceback's frames hold it
    _run._strip(caught)
    assert alive() is None  # without a collection: its sockets would close at the group's destroy
    if sys.version_info >= (3, 11):
        (note,) = caught.__notes__
        assert note.startswith(_run.RAISED_AT) and "in inner" in note
        assert 'raise RuntimeError("Connection closed by peer")' in note


def test_grads_are_cleared_in_modules_optimizers_and_nested_states() -> None:
    model = torch.nn.Linear(3, 2)
    other = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    other(torch.ones(1, 2)).sum().backward()
    state = Holder(model=model, optimizer=opt, extra={"m": [other]})
    assert _run.clear_grads(state) == 4
    assert all(p.grad is None for p in [*model.parameters(), *other.parameters()])
    assert _run.clear_grads(state) == 0


@attrs.define
class Holder:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    extra: dict


def test_workers_are_ranked_by_their_stable_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic.recovery import rendezvous as _rendezvous

    monkeypatch.setenv("ELASTIC_SLOT", "7")
    pid = _run._participant_id()
    assert _rendezvous.order_of(pid) == 7
    monkeypatch.delenv("ELASTIC_SLOT")
    monkeypatch.setenv("RANK", "3")
    assert _rendezvous.order_of(_run._participant_id()) == 3
    monkeypatch.delenv("RANK")
    assert _rendezvous.order_of(_run._participant_id()) is None
    # joined in the order 2, 0, 1: ranked 0, 1, 2; ids without an order keep theirs, after
    assert _rendezvous.ranked(["2.h-1", "x.h-9", "0.h-2", "1.h-3", "x.h-8"]) == (
        "0.h-2",
        "1.h-3",
        "2.h-1",
        "x.h-9",
        "x.h-8",
    )
    log = _rendezvous.Log(joined=("2.h", "0.h", "1.h"))
    assert _rendezvous.decide(
        (), log, alive=lambda p: True, ready=lambda p: True, min_workers=1, max_workers=9, quiet=True
    ) == ("0.h", "1.h", "2.h")
    # max_workers still prefers the previous members, then ranks the chosen ones
    log = _rendezvous.Log(joined=("0.new", "2.old", "1.old"))
    assert _rendezvous.decide(
        ("1.old", "2.old"),
        log,
        alive=lambda p: True,
        ready=lambda p: True,
        min_workers=1,
        max_workers=2,
        quiet=False,
    ) == ("1.old", "2.old")


def test_check_exchanges_the_flag_every_check_every_calls(single_group: Any) -> None:
    rdzv = FakeRendezvous({"a"})
    world = make_world(rdzv, group=single_group, check_every=3)
    for _ in range(6):
        world.check()
    assert rdzv.pending_calls == 2 and rdzv.progressed >= 6
    rdzv._pending = True
    world.check()
    world.check()
    with pytest.raises(_run._EndGeneration) as info:
        world.check()
    assert info.value.leaving is False
    assert not isinstance(info.value, Exception)  # user code's `except Exception` does not swallow it


def test_check_takes_a_builders_snapshot_every_snapshot_every_calls(single_group: Any) -> None:
    rdzv = FakeRendezvous({"a"})
    world = make_world(rdzv, group=single_group, check_every=3)
    taken: list[int] = []
    world._snapshot = (2, lambda: taken.append(world._calls))
    for _ in range(7):
        world.check()
    assert taken == [2, 4, 6]  # on its own count, whatever check_every is
    assert rdzv.pending_calls == 2


def test_a_sigterm_makes_check_leave(single_group: Any) -> None:
    rdzv = FakeRendezvous({"a"})
    with _run._Departure() as departure:
        world = make_world(rdzv, group=single_group, leave_requested=departure.requested.is_set)
        world.check()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not departure.requested.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(_run._EndGeneration) as info:
            world.check()
    assert info.value.leaving and rdzv.left
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    assert signal.getsignal(signal.SIGTERM) is not departure._handle


@pytest.fixture
def store_address() -> Any:
    server = serve("127.0.0.1", 0, timeout=timedelta(seconds=10))
    yield format_address("127.0.0.1", server.port)
    del server


def test_run_in_one_process_returns_fn_value_and_later_joiners_get_none(store_address: str) -> None:
    state = Toy(w=torch.zeros(4))
    seen: list[Any] = []

    def fn(s: Toy, world: Any) -> int:
        seen.append((world.rank, world.size, world.generation))
        world.check()
        return 41 + world.size

    hook = sys.excepthook
    assert elastic.run(fn, state, rdzv=store_address, run_id="one", timeout=5) == 42
    assert seen == [(0, 1, 0)]
    assert not dist.is_initialized() and sys.excepthook is hook
    assert elastic.run(fn, state, rdzv=store_address, run_id="one", timeout=5) is None  # finished
    assert seen == [(0, 1, 0)]


def test_run_propagates_fn_errors_and_too_few_workers_time_out(store_address: str) -> None:
    state = Toy(w=torch.zeros(4))

    def fn(s: Toy, world: Any) -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        elastic.run(fn, state, rdzv=store_address, run_id="raise", timeout=5)
    assert not dist.is_initialized()
    with pytest.raises(elastic.ElasticError):
        elastic.run(fn, state, rdzv=store_address, run_id="few", min_workers=2, join_timeout=1, timeout=5)
    assert not dist.is_initialized()


def test_bad_arguments() -> None:
    state = Toy(w=torch.zeros(1))
    with pytest.raises(TypeError, match="fn must be callable"):
        elastic.run(3, state, rdzv="127.0.0.1:1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_workers"):
        elastic.run(lambda s, w: None, state, rdzv="127.0.0.1:1", min_workers=0)
    with pytest.raises(ValueError, match="max_workers"):
        elastic.run(lambda s, w: None, state, rdzv="127.0.0.1:1", min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="check_every"):
        elastic.run(lambda s, w: None, state, rdzv="127.0.0.1:1", check_every=0)
    with pytest.raises(ValueError, match=r"first_workers=\.\.\.\) must be an int >= 2"):
        elastic.run(lambda s, w: None, state, rdzv="127.0.0.1:1", min_workers=2, first_workers=1)
    with pytest.raises(ValueError, match="must not exceed max_workers=3"):
        elastic.run(lambda s, w: None, state, rdzv="127.0.0.1:1", max_workers=3, first_workers=4)
    with pytest.raises(TypeError):
        elastic.run(lambda s, w: None, object(), rdzv="127.0.0.1:1")
    with pytest.raises(
        TypeError, match=r"snapshot_every=5\): snapshots are for sharded states.*drop snapshot_every"
    ):
        elastic.run(lambda s, w: None, state, rdzv="127.0.0.1:1", snapshot_every=5)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=r"snapshot_every=\.\.\.\) must be an int >= 1, got"):
            elastic.run(lambda s, w: None, lambda world: None, rdzv="127.0.0.1:1", snapshot_every=bad)
    for wrong in (2.5, True, "5"):
        with pytest.raises(TypeError, match=r"snapshot_every=\.\.\.\) must be an int >= 1 or None"):
            elastic.run(lambda s, w: None, lambda world: None, rdzv="127.0.0.1:1", snapshot_every=wrong)
    with pytest.raises(ValueError, match="restart"):
        elastic.spawn(lambda: None, 2, restart="machine")
    with pytest.raises(ValueError, match=r"backend='nccl', restart='worker'.*picks its backend itself"):
        elastic.spawn(lambda: None, 2, backend="nccl", restart="worker")


# --------------------------------------------------------------------------------------------------------
# Many machines on one host: one store, one torchrun per "machine"

MACHINE_SCRIPT = """
import json, os, signal, sys, time
import attrs, torch, torch.distributed as dist
import elastic


@elastic.elastic_state(tenure=lambda s: s.step)
@attrs.define
class Toy:
    w: torch.Tensor
    step: int = 0


machine, local = os.environ["MACHINE"], int(os.environ["LOCAL_RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
gens = []


def train(s, world):
    gens.append((world.generation, world.size, s.step))
    while not (s.step >= 40 and world.size == 3):
        if s.step > 3000:
            raise AssertionError("never finished")
        world.check()
        if machine == "B" and local == 1 and restart == 0 and s.step >= 15 and world.size == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.full((4,), float(s.step + 1))
        dist.all_reduce(g)
        s.w.add_(g / world.size)
        s.step += 1
        time.sleep(0.01)
    elastic.verify(s)
    return s.step, s.w.tolist()


result = elastic.run(train, Toy(torch.zeros(4)), timeout=20)
with open(os.path.join(sys.argv[1], f"{machine}-{local}-{restart}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "gens": gens, "result": result}, f)
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.torchrun
def test_two_torchruns_share_one_store_and_only_the_failed_machine_restarts(tmp_path: Path) -> None:
    import json
    import re

    script = tmp_path / "train.py"
    script.write_text(MACHINE_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    store_log = (tmp_path / "store.log").open("w")
    store = subprocess.Popen(
        [sys.executable, "-m", "elastic.store", "--host", "127.0.0.1", "--port", "0"],
        stdout=store_log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None and time.monotonic() < deadline:
            found = re.search(r"127\.0\.0\.1:(\d+)", (tmp_path / "store.log").read_text())
            port = int(found.group(1)) if found else None
            time.sleep(0.1)
        assert port is not None, (tmp_path / "store.log").read_text()
        for machine, nproc in (("A", 1), ("B", 2)):
            log = (tmp_path / f"torchrun-{machine}.log").open("w")
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--max-restarts=1", "--monitor-interval=0.1", str(script), str(out),
            ]  # fmt: skip
            run_env = dict(env, MACHINE=machine, ELASTIC_RDZV=f"127.0.0.1:{port}")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env))
        for p in procs:
            p.wait(timeout=100)
        logs = {m: (tmp_path / f"torchrun-{m}.log").read_text() for m in "AB"}
        assert [p.returncode for p in procs] == [0, 0], logs
    finally:
        for p in [*procs, store]:
            if p.poll() is None:
                p.kill()
                p.wait()
        store_log.close()
    files = sorted(p.name for p in out.iterdir())
    # machine A: one life, never restarted; machine B: the killed worker's torchrun restarted both of its
    # workers (torchrun restarts a machine's whole worker group): the survivor left on SIGTERM (None)
    assert files == ["A-0-0.json", "B-0-0.json", "B-0-1.json", "B-1-1.json"], files
    rec = {name[:-5]: json.loads((out / name).read_text()) for name in files}
    assert rec["B-0-0"]["result"] is None
    finals = {tuple(map(tuple, [r["result"][1]])) for k, r in rec.items() if k != "B-0-0"}
    assert len(finals) == 1
    steps = {r["result"][0] for k, r in rec.items() if k != "B-0-0"}
    (n,) = steps
    assert rec["A-0-0"]["result"][1] == [expected_w(n)] * 4
    assert rec["A-0-0"]["gens"][0][2] == 0 and len(rec["A-0-0"]["gens"]) >= 3  # 3 -> smaller -> 3 workers
    for k in ("B-0-1", "B-1-1"):
        assert rec[k]["gens"][0][2] >= 15  # the restarted workers received the state


# --------------------------------------------------------------------------------------------------------
# What real scripts do: gradients, reproducible ranks, a first generation of all, a save on rank 0 only


@elastic.elastic_state(tenure=lambda s: s.step)
@attrs.define
class Net:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


def script_worker(tmp: str) -> dict[str, Any]:
    """nanoGPT's shape: gradients zeroed at the END of a step, one worker killed after its backward, then
    eval-and-save on rank 0 only (a bug: save is collective)."""
    slot = int(os.environ["ELASTIC_SLOT"])
    life = int(os.environ["ELASTIC_SLOT_RESTARTS"])
    if life == 0:
        time.sleep({0: 1.5, 1: 0.0, 2: 3.0}[slot])  # join order 1, 0, 2; slot 2 after the last call
    torch.manual_seed(100 + slot)  # per-worker seeds: the elected state must not depend on join order
    model = torch.nn.Linear(4, 2)
    state = Net(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rec: dict[str, Any] = {
        "slot": slot,
        "life": life,
        "gens": [],
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
    }

    def train(s: Net, world: Any) -> None:
        grads = [p.grad is not None for p in s.model.parameters()]
        rec["gens"].append((world.generation, world.size, world.rank, s.step, grads))
        with open(Path(tmp) / f"gens-{slot}", "a") as f:  # slot 2's first life does not return
            f.write(f"{world.generation} {world.size} {world.rank}\n")
        if world.generation == 0:
            rec["first_weight"] = s.model.weight.detach().clone().tolist()
        while True:
            world.check()
            x = torch.full((3, 4), float(s.step % 5))
            s.model(x).pow(2).mean().backward()
            if slot == 2 and life == 0 and s.step == 4:
                os.kill(os.getpid(), signal.SIGKILL)  # after its backward: the survivors hold gradients
            for p in s.model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world.size
            s.optimizer.step()
            s.optimizer.zero_grad(set_to_none=True)
            s.step += 1
            if s.step > 3000:
                raise AssertionError("the scenario never reached its save")
            if s.step >= 8 and world.size == 3:
                if world.rank == 0:
                    elastic.save(s, Path(tmp) / "ckpt")  # only the master: the others go on training
                else:
                    dist.all_reduce(torch.ones(1))

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        elastic.run(train, state, min_workers=2, first_workers=3, timeout=4, join_timeout=60)
    except elastic.ElasticError as exc:
        rec["error"] = str(exc)
    return rec


def test_a_real_scripts_traps_gradients_ranks_first_generation_and_a_save_on_rank_0_only(
    tmp_path: Path,
) -> None:
    results = elastic.spawn(
        script_worker, 3, args=(str(tmp_path),), restart="worker", max_restarts=1, timeout=110
    )
    first = [(tmp_path / f"gens-{s}").read_text().splitlines()[0] for s in (0, 1, 2)]
    # the first generation waited for all three (first_workers=3), ranked by slot whatever the join order
    assert first == ["0 3 0", "0 3 1", "0 3 2"]
    # tenure ties go to rank 0 = slot 0: everyone starts from slot 0's seed, run after run
    torch.manual_seed(100)
    assert results[1]["first_weight"] == torch.nn.Linear(4, 2).weight.tolist()
    # after the kill the survivors started the next generation with no gradient left from step 4
    for s in (0, 1):
        gens = results[s]["gens"]
        assert len(gens) >= 3, gens
        assert all(not any(g[4]) for g in gens), gens
        assert gens[1][1] == 2 and gens[1][3] == 4  # the step in flight was lost, nothing else
    assert results[2]["life"] == 1
    # rank 0 in save, ranks 1 and 2 in a collective of their own: every rank says so, nobody loops
    for r in results:
        err = r["error"]
        assert "different operations" in err, err
        assert "rank 0 in save() (phase" in err, err
        assert "ranks 1, 2 in a collective of fn" in err, err
        assert "not on rank 0 only" in err
        assert r["gens"][-1][1] == 3
    assert len({r["error"] for r in results}) == 1  # the same verdict on every rank
    # several workers on one host: one intra-op thread each (as torchrun does)
    assert {(r["omp"], r["threads"]) for r in results} == {("1", 1)}


def stall_worker() -> dict[str, Any]:
    """Slot 1 hangs (SIGSTOP) at step 3 in every generation: the run stops instead of regrouping forever."""
    _run.STALL_LIMIT = 2
    slot = int(os.environ["ELASTIC_SLOT"])
    state = Toy(w=torch.zeros(1))
    out: dict[str, Any] = {"gens": []}

    def train(s: Toy, world: Any) -> None:
        out["gens"].append((world.generation, s.step))
        while True:
            world.check()
            if slot == 1 and s.step == 3:
                subprocess.Popen(["sh", "-c", f"sleep 3; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
            g = torch.ones(1)
            dist.all_reduce(g)
            if s.step < 3:
                s.step += 1

    try:
        elastic.run(train, state, min_workers=2, timeout=2, join_timeout=20)
    except elastic.ElasticError as exc:
        out["error"] = str(exc)
    return out


def test_generations_that_keep_failing_at_one_tenure_end_in_an_error_with_their_history() -> None:
    results = elastic.spawn(stall_worker, 2, restart="worker", timeout=100)
    err = results[0]["error"]
    assert "2 generations in a row failed before a step completed, all at tenure 3" in err, err
    assert "stopped heartbeating (dead or hung)" in err
    assert [step for _, step in results[0]["gens"]][-2:] == [3, 3]


def test_busy_keeps_heartbeating_past_timeout_and_tells_the_others_where_it_is() -> None:
    from elastic.recovery.rendezvous import Rendezvous

    rdzv = Rendezvous(
        dist.HashStore(), "t", "0.a", join_timeout=timedelta(seconds=5), timeout=timedelta(seconds=1)
    )
    rdzv._last_progress = time.monotonic() - 10  # silent for ten timeouts: hung
    assert not rdzv._making_progress(time.monotonic())
    store = dist.HashStore()
    gen = _run._Generation(store, FakeMembership(rank=1))
    peer = _run._Generation(store, FakeMembership(rank=0))
    world = make_world(rdzv, rank=1, size=2, generation=3, timeout=timedelta(seconds=1), note=gen.note)
    assert world.mesh is None
    with world.busy("compile"):
        rdzv._last_progress = time.monotonic() - 10
        assert rdzv._making_progress(time.monotonic())
        assert peer.notes() == {1: "world.busy('compile')"}
        with world.busy("eval"):
            assert peer.notes() == {1: "world.busy('eval')"}
        assert peer.notes() == {1: "world.busy('compile')"}  # the outer block still runs
        assert rdzv._making_progress(time.monotonic())
    assert rdzv._making_progress(time.monotonic())  # leaving the block is progress
    assert peer.notes() == {}
    rdzv._last_progress = time.monotonic() - 10
    world.progress()
    assert rdzv._making_progress(time.monotonic())


class ExpiringRendezvous(FakeRendezvous):
    """Members are judged expired once they stood still longer than the `within` asked."""

    def __init__(self, still: dict[str, float]) -> None:
        super().__init__({"a", "b"})
        self.still = still  # member -> seconds its heartbeat has stood still
        self.grace = 2.0
        self.asked: list[float] = []

    def expired(self, within: float) -> list[str]:
        self.asked.append(within)
        return [m for m, s in self.still.items() if s > within]


def test_the_watch_writes_the_regroup_verdict_before_it_ends_the_collectives() -> None:
    """A peer judged gone (rightly or not) costs one regroup on every rank, never a raw backend error;
    while the generation starts the watch waits longer than once fn runs."""
    store = dist.HashStore()
    gen, peer = _run._Generation(store, FakeMembership()), _run._Generation(store, FakeMembership(rank=1))
    shut: list[int] = []

    class Counting:
        def shutdown(self) -> int:
            shut.append(1)
            return 2

    rdzv = ExpiringRendezvous({"b": 1.5})  # stood still 1.5 s: within the start's grace, past fn's bound
    watch = _run._Watch(rdzv, gen, None, Counting())  # type: ignore[arg-type]
    assert watch._evidence(["a", "b"]) is None  # starting: the rendezvous's grace (2 s here)
    watch.training.set()
    assert watch.stale_after == 1.0  # twice the expiry (0.02 s), at least 1 s
    why = watch._evidence(["a", "b"])
    assert why == "rank(s) [1] stopped heartbeating (dead or hung)"  # as _judge words it
    watch._end(why)
    assert shut == [1]
    assert peer.verdict(None) == _run.REGROUP + why  # what every _judge adopts
    timed_out = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    assert _judge(timed_out, FakeRendezvous({"a", "b"}), peer) == _run.REGROUP + why
