"""Recovery from killed workers: `elastic.run` against torchrun restarts and torchft, same model and kills.

Three workers train the same MLP (DDP-style gradient all-reduce, Adam) on synthetic data. `--kills`
SIGKILLs (default 10) hit the workers at random steps (seeded; slot i % 3 dies at the first step at or
after the i-th scheduled step with all three workers present); each killed worker is restarted in its slot
and rejoins. Measured per failure, from the worker's own timestamps:

- elastic: ``elastic.spawn(restart="worker")`` + ``elastic.run``: seconds from the kill to the first step
  the survivors complete after regrouping (median, max), steps redone, and the joiner's admission latency
  (from its call of ``run`` to the start of its first generation). At the end one worker gets SIGTERM:
  the departure's cost in steps and seconds.
- elastic with loader workers: the same, each worker's batches coming from a ``DataLoader(num_workers=2)``
  (``--loader-workers``; forked, Linux's default), whose workers are alive at every kill. A killed
  worker's loader workers inherit its gloo connections and live on until their parent check (every 5 s);
  `elastic.run` makes forked children drop them (`elastic.recovery.fork`), so the survivors see the EOF
  at once.
- torchrun: ``--max-restarts`` restarts every worker, which resume from the last checkpoint (every 20
  steps): seconds from the kill to the first step completed after the restart, and steps lost.
- torchft 0.2.0 (the ``bench`` extra): one replica group per worker, gloo, its Lighthouse in this process
  tuned (``join_timeout_ms=1000, quorum_tick_ms=100``) and with its defaults: seconds from the kill to the
  survivors' first committed step after it, and steps lost.

    python benchmarks/bench_recovery.py [--kills 10] [--seed 0] [--loader-workers 2] [--skip-torchft]
        [--skip-torchrun]

Not a timed test: it prints a table (docs/performance.md, "Recovery").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

import elastic

IN, HIDDEN, OUT, BATCH = 32, 256, 8, 64
CKPT_EVERY = 20
AFTER = 25  # steps trained after the SIGTERM departure


def schedule(kills: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    steps, at = [], 30
    for _ in range(kills):
        steps.append(at)
        at += rng.randint(25, 45)
    return steps


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )  # fmt: skip


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, x[:, :OUT].sin()


class StepData(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``data(first + i, rank)`` as a dataset, for a DataLoader whose workers make the batches."""

    def __init__(self, first: int, rank: int) -> None:
        self.first, self.rank = first, rank

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return data(self.first + i, self.rank)


def grad_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    rank: int,
    size: int,
    batch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Forward, backward, all-reduce of the gradients (one flat bucket, as DDP does), optimizer step."""
    x, y = data(step, rank) if batch is None else batch
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    opt.step()


class Log:
    """Timestamped events of one worker process, one line each: time slot life kind step size."""

    def __init__(self, root: str, slot: int, life: int) -> None:
        self.slot, self.life = slot, life
        self.f = open(Path(root) / f"events-{slot}-{life}-{os.getpid()}.txt", "a", buffering=1)  # noqa: SIM115

    def __call__(self, kind: str, step: int, size: int = 0) -> None:
        self.f.write(f"{time.time():.6f} {self.slot} {self.life} {kind} {step} {size}\n")


@contextlib.contextmanager
def quiet(root: str) -> Any:
    """The workers' output goes to a file (torchft logs every quorum); set BENCH_VERBOSE=1 to see it."""
    if os.environ.get("BENCH_VERBOSE"):
        yield
        return
    with (
        open(Path(root) / "output.log", "w") as f,
        contextlib.redirect_stdout(f),
        contextlib.redirect_stderr(f),
    ):
        yield


def read_events(root: str) -> list[tuple[float, int, int, str, int, int]]:
    out = []
    for path in Path(root).glob("events-*.txt"):
        for line in path.read_text().splitlines():
            t, slot, life, kind, step, size = line.split()
            out.append((float(t), int(slot), int(life), kind, int(step), int(size)))
    return sorted(out)


# --------------------------------------------------------------------------------------------------------
# elastic


@elastic.elastic_state(tenure=lambda s: s.step)
@attrs.define
class State:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0
    kills: int = 0  # kills done so far: every rank counts them alike
    term_at: int = -1  # the step of the SIGTERM departure


def elastic_worker(root: str, kill_steps: list[int], loader_workers: int = 0) -> Any:
    slot, life = int(os.environ["ELASTIC_SLOT"]), int(os.environ["ELASTIC_SLOT_RESTARTS"])
    log = Log(root, slot, life)
    model = make_model()
    state = State(model, torch.optim.Adam(model.parameters(), lr=1e-3))

    def train(s: State, world: elastic.World) -> int:
        log("gen", s.step, world.size)
        batches = None
        if loader_workers:  # this generation's steps, from s.step on, made by the loader's workers
            loader = torch.utils.data.DataLoader(
                StepData(s.step, world.rank), batch_size=None, num_workers=loader_workers
            )
            batches = iter(loader)
        while s.term_at < 0 or s.step < s.term_at + AFTER:
            world.check()
            if s.kills < len(kill_steps) and s.step >= kill_steps[s.kills] and world.size == 3:
                if slot == s.kills % 3:
                    log("kill", s.step, world.size)
                    os.kill(os.getpid(), signal.SIGKILL)
                s.kills += 1
            elif s.kills == len(kill_steps) and s.term_at < 0 and world.size == 3:
                s.term_at = s.step
                if slot == 0:
                    log("term", s.step, world.size)
                    os.kill(os.getpid(), signal.SIGTERM)  # leaves at the next check(), with the others
            batch = None if batches is None else next(batches)
            grad_step(s.model, s.optimizer, s.step, world.rank, world.size, batch)
            s.step += 1
            log("done", s.step, world.size)
        return s.step

    log("join", state.step)
    return elastic.run(train, state, timeout=30)


def bench_elastic(kill_steps: list[int], loader_workers: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        started = time.monotonic()
        with quiet(root):
            elastic.spawn(
                elastic_worker,
                3,
                args=(root, kill_steps, loader_workers),
                restart="worker",
                max_restarts=len(kill_steps),
                timeout=900,
            )
        wall = time.monotonic() - started
        ev = read_events(root)
    recoveries, redone, admissions = [], [], []
    for t, slot, life, kind, _step, _ in ev:
        if kind != "kill":
            continue
        before = [e for e in ev if e[3] == "done" and e[0] < t and e[1] != slot]
        last = max(e[4] for e in before)
        after = [e for e in ev if e[3] == "done" and e[0] > t and e[1] != slot and e[5] == 2]
        gen = min((e for e in ev if e[3] == "gen" and e[0] > t and e[1] != slot), key=lambda e: e[0])
        recoveries.append(after[0][0] - t)
        redone.append(last - gen[4])
        join = next(e for e in ev if e[3] == "join" and e[1] == slot and e[2] == life + 1)
        first = next(e for e in ev if e[3] == "gen" and e[1] == slot and e[2] == life + 1)
        admissions.append(first[0] - join[0])
    term = next(e for e in ev if e[3] == "term")
    gen = min((e for e in ev if e[3] == "gen" and e[0] > term[0] and e[1] != term[1]), key=lambda e: e[0])
    before = max((e for e in ev if e[3] == "done" and e[0] < gen[0] and e[1] != term[1]), key=lambda e: e[0])
    after = min((e for e in ev if e[3] == "done" and e[0] > gen[0] and e[1] != term[1]), key=lambda e: e[0])
    return {
        "recovery": recoveries,
        "lost": redone,
        "admission": admissions,
        "term_lost": before[4] - gen[4],
        "term_pause": after[0] - before[0],
        "wall": wall,
    }


# --------------------------------------------------------------------------------------------------------
# torchrun: restart the group from a checkpoint


def torchrun_worker(root: str, kill_steps: list[int]) -> None:
    elastic.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    log = Log(root, rank, attempt)
    model = make_model()
    state = State(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    elastic.load(state, Path(root) / "ckpt")
    log("gen", state.step, size)
    end = kill_steps[-1] + AFTER
    while state.step < end:
        if attempt < len(kill_steps) and state.step >= kill_steps[attempt] and rank == attempt % 3:
            log("kill", state.step, size)
            os.kill(os.getpid(), signal.SIGKILL)
        grad_step(state.model, state.optimizer, state.step, rank, size)
        state.step += 1
        log("done", state.step, size)
        if state.step % CKPT_EVERY == 0:
            elastic.save(state, Path(root) / "ckpt", keep=2)
    dist.destroy_process_group()
    os._exit(0)


def bench_torchrun(kill_steps: list[int]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        started = time.monotonic()
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
            f"--max-restarts={len(kill_steps)}", __file__, "--torchrun-worker", root,
            "--schedule", ",".join(map(str, kill_steps)),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
        wall = time.monotonic() - started
        ev = read_events(root)
    recoveries, lost = [], []
    for t, _slot, life, kind, step, _ in ev:
        if kind != "kill":
            continue
        nxt = [e for e in ev if e[2] == life + 1]
        gen = min((e for e in nxt if e[3] == "gen"), key=lambda e: e[0])
        first = min((e for e in nxt if e[3] == "done"), key=lambda e: e[0])
        recoveries.append(first[0] - t)
        lost.append(step - gen[4])
    return {"recovery": recoveries, "lost": lost, "wall": wall}


# --------------------------------------------------------------------------------------------------------
# torchft 0.2.0: one replica group (of one process) per worker, its Lighthouse in this process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchft_worker(root: str, kill_steps: list[int], lighthouse: str) -> int:
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    slot, life = int(os.environ["ELASTIC_SLOT"]), int(os.environ["ELASTIC_SLOT_RESTARTS"])
    log = Log(root, slot, life)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    extra = {"kills": 0}

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "kills": extra["kills"]}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        extra["kills"] = sd["kills"]

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica{slot}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        port=free_port(),
        timeout=timedelta(seconds=30),
    )
    optimizer = OptimizerWrapper(manager, opt)  # zero_grad() starts the quorum
    log("join", 0)
    end = kill_steps[-1] + AFTER
    seen_gen = None
    while True:
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum
        n = manager.num_participants()
        if step >= end and n == 3 and extra["kills"] == len(kill_steps):
            break  # the same decision on every replica: same step, same quorum
        if seen_gen != n:
            log("gen", step, n)
            seen_gen = n
        k = extra["kills"]
        if k < len(kill_steps) and step >= kill_steps[k] and n == 3:
            if slot == k % 3:
                log("kill", step, n)
                os.kill(os.getpid(), signal.SIGKILL)
            extra["kills"] += 1
        x, y = data(step, manager.participating_rank() or 0)
        F.mse_loss(model(x), y).backward()
        for p in model.parameters():
            if p.grad is not None:
                manager.allreduce(p.grad).wait()
        if manager.should_commit():  # every replica's all-reduce succeeded: apply the step
            opt.step()
            log("done", manager.current_step(), n)
    manager.shutdown(wait=False)
    return int(manager.current_step())


def bench_torchft(kill_steps: list[int], tuned: bool) -> dict[str, Any]:
    from torchft._torchft import LighthouseServer

    options = {"join_timeout_ms": 1000, "quorum_tick_ms": 100} if tuned else {}
    server = LighthouseServer(bind="[::]:0", min_replicas=2, **options)
    try:
        with tempfile.TemporaryDirectory() as root:
            started = time.monotonic()
            with quiet(root):
                elastic.spawn(
                    torchft_worker,
                    3,
                    args=(root, kill_steps, server.address()),
                    restart="worker",
                    max_restarts=len(kill_steps),
                    timeout=1800,
                )
            wall = time.monotonic() - started
            ev = read_events(root)
    finally:
        server.shutdown()
    recoveries, lost = [], []
    for t, slot, _life, kind, step, _ in ev:
        if kind != "kill":
            continue
        before = [e for e in ev if e[3] == "done" and e[0] < t and e[1] != slot]
        after = [e for e in ev if e[3] == "done" and e[0] > t and e[1] != slot and e[4] > step]
        recoveries.append(after[0][0] - t)
        lost.append(max(e[4] for e in before) - (after[0][4] - 1))
    return {"recovery": recoveries, "lost": lost, "wall": wall}


# --------------------------------------------------------------------------------------------------------


def row(name: str, r: dict[str, Any]) -> str:
    rec = r["recovery"]
    lost = r["lost"]
    return (
        f"| {name} | {statistics.median(rec):.2f} | {max(rec):.2f} | {statistics.mean(lost):.1f} "
        f"(max {max(lost)}) | {r['wall']:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--loader-workers", type=int, default=2, help="DataLoader workers per worker in its row (0: no row)"
    )
    parser.add_argument("--skip-torchft", action="store_true")
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--torchrun-worker", metavar="ROOT", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchrun_worker:
        torchrun_worker(args.torchrun_worker, [int(s) for s in args.schedule.split(",")])
        return
    kill_steps = schedule(args.kills, args.seed)
    print(f"3 workers, {args.kills} SIGKILLs at steps >= {kill_steps}", flush=True)
    results = {"elastic.run": bench_elastic(kill_steps)}
    e = results["elastic.run"]
    print(
        f"elastic: joiner admitted {statistics.median(e['admission']):.2f} s median "
        f"(max {max(e['admission']):.2f}) after calling run; SIGTERM departure: {e['term_lost']} steps lost, "
        f"{e['term_pause']:.2f} s between the survivors' steps around it",
        flush=True,
    )
    if args.loader_workers:
        e = bench_elastic(kill_steps, args.loader_workers)
        results[f"elastic.run, DataLoader(num_workers={args.loader_workers}) in each worker"] = e
        print(
            f"elastic with loader workers: joiner admitted {statistics.median(e['admission']):.2f} s median "
            f"(max {max(e['admission']):.2f}) after calling run",
            flush=True,
        )
    if not args.skip_torchrun:
        results[f"torchrun restart, checkpoint every {CKPT_EVERY}"] = bench_torchrun(kill_steps)
    if not args.skip_torchft:
        try:
            import torchft  # noqa: F401
        except ImportError:
            print("torchft is not installed: pip install -e '.[bench]'")
        else:
            results["torchft 0.2.0, Lighthouse tuned (1000 ms join, 100 ms tick)"] = bench_torchft(
                kill_steps, True
            )
            results["torchft 0.2.0, Lighthouse defaults"] = bench_torchft(kill_steps, False)
    print()
    print("| recovery | failure -> first step after (s), median | max | steps lost per failure | run (s) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(row(name, r))


if __name__ == "__main__":
    main()
