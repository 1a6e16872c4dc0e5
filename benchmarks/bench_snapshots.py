"""Training with in-memory snapshots against training without: steps per second under `elastic.run`.

The state: an MLP of ``nn.Linear(WIDTH, WIDTH)`` layers, each under `fully_shard` and the root too, Adam
(``--mib`` in all with its two moments, default 48) and a step counter, on a pure-FSDP mesh ``("shard",)``
of three gloo ranks on the CPU (``OMP_NUM_THREADS=1``), built by a builder under
``elastic.run(fn, build, mesh=...)`` in workers of ``elastic.spawn(..., restart="worker")``. A step is a
forward and backward pass on ``--batch`` rows and an Adam step, then ``world.check()``.

Each round runs two `elastic.run`s one after the other in the same worker processes (run ids of their own),
one with ``snapshot_every=k`` (``--every``, default 10) and one without, the order alternating between
rounds; in each, after ``--warmup`` steps, ``--steps`` steps (a multiple of k, so that every timed window
holds the same number of snapshots) are timed between two barriers. A round's time is the slower rank's;
the table gives the medians over rounds, the steps per second and their ratio (with / without: the
target is >= 0.9), and the median of each round's own ratio (less exposed to a load that drifts). The
snapshot variant counts its snapshots (each rank copies its pieces to CPU memory and sends them to the
next rank in a background thread) and fails when there were not steps/k of them; it also times the step's
blocking per snapshot (the main thread inside the snapshot: the device-to-host copy).

    python benchmarks/bench_snapshots.py                           # 48 MiB, 5 rounds
    python benchmarks/bench_snapshots.py --mib 16 --rounds 3 --json snapshots.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

import elastic

MiB = 2**20
WIDTH = 1024
TARGET = 0.9


@elastic.elastic_state(tenure="step")
@attrs.define
class Trained:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


def build(world: Any, mib: int) -> Trained:
    """The state on ``world.mesh`` (the same values on every rank)."""
    from torch.distributed.fsdp import fully_shard

    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 3  # weights and bias, and Adam's two moments, fp32
    layers = max(1, round(mib * MiB / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=world.mesh)
    fully_shard(model, mesh=world.mesh)
    return Trained(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4))


def train_step(state: Trained, batch: int) -> None:
    x = torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(state.step))
    state.model(x).pow(2).mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1


def timed(state: Trained, world: Any, args: Any, every: int | None) -> dict[str, Any]:
    """``fn``: warm-up steps, then `args.steps` steps timed between two barriers."""
    taken, blocked = [0], [0.0]
    if every is not None:
        if world._snapshot is None:  # the benchmark would measure nothing
            msg = "bench_snapshots: run(snapshot_every=...) installed no snapshot in world.check()"
            raise RuntimeError(msg)
        k, take = world._snapshot

        def counted() -> None:
            t0 = time.perf_counter()
            take()
            taken[0] += 1
            blocked[0] += time.perf_counter() - t0

        world._snapshot = (k, counted)
    for _ in range(args.warmup):
        train_step(state, args.batch)
        world.check()
    before, blocked[0] = taken[0], 0.0
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step(state, args.batch)
        world.check()
    dist.barrier()
    seconds = time.perf_counter() - t0
    own = sum(p.to_local().nbytes for p in state.model.parameters())
    own += sum(
        v.to_local().nbytes for per in state.optimizer.state.values() for v in per.values() if v.dim() > 0
    )
    return {"seconds": seconds, "snapshots": taken[0] - before, "blocked": blocked[0], "own": own}


def worker(args: Any) -> dict[str, list[Any]]:
    torch.set_num_threads(1)
    out: dict[str, list[Any]] = {"with": [], "without": []}
    order = ["with", "without"]
    for r in range(args.rounds + 1):
        for key in order if r % 2 == 0 else order[::-1]:
            every = args.every if key == "with" else None
            result = elastic.run(
                lambda state, world, every=every: timed(state, world, args, every),
                lambda world: build(world, args.mib),
                run_id=f"{key}-{r}",
                first_workers=args.ranks,
                timeout=60,
                snapshot_every=every,
            )
            if r > 0:  # round 0 warms up
                out[key].append(result)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=48, help="state size: parameters and Adam's moments")
    parser.add_argument("--ranks", type=int, default=3, help="workers on the 1-D mesh")
    parser.add_argument("--every", type=int, default=10, help="snapshot_every of the snapshot variant")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (a multiple of --every)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--batch", type=int, default=64, help="rows per step and rank")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (one more warms up)")
    parser.add_argument("--json", default=None, help="write the numbers to this file")
    args = parser.parse_args()
    if args.steps % args.every:
        parser.error(f"--steps {args.steps} must be a multiple of --every {args.every}")
    os.environ["OMP_NUM_THREADS"] = "1"
    load_before = os.getloadavg()[0]
    per_slot = elastic.spawn(worker, args.ranks, args=(args,), restart="worker", timeout=3600)
    rows: dict[str, Any] = {}
    for key in ("with", "without"):
        per_round = zip(*(slot[key] for slot in per_slot), strict=True)
        seconds = [max(r["seconds"] for r in rs) for rs in per_round]
        rows[key] = {
            "seconds": seconds,
            "median": statistics.median(seconds),
            "steps_per_second": args.steps / statistics.median(seconds),
        }
    expected = args.steps // args.every
    counts = {r["snapshots"] for slot in per_slot for r in slot["with"]}
    if counts != {expected}:
        msg = f"the snapshot variant took {sorted(counts)} snapshots per timed window, not {expected}"
        raise RuntimeError(msg)
    own = max(r["own"] for slot in per_slot for r in slot["with"]) / MiB
    # the main thread's time inside take() per snapshot (the device-to-host copy), the slowest rank's
    blocked = statistics.median(
        max(r["blocked"] for r in rs) / expected
        for rs in zip(*(slot["with"] for slot in per_slot), strict=True)
    )
    ratio = rows["with"]["steps_per_second"] / rows["without"]["steps_per_second"]
    # the same, round by round (the two runs of a round are next to each other in time): less load drift
    paired = statistics.median(b / a for a, b in zip(rows["with"]["seconds"], rows["without"]["seconds"]))
    print(
        f"\nstate: {args.mib} MiB (FSDP2 MLP + Adam) on a ({args.ranks},) mesh, {own:.1f} MiB of pieces per "
        f"rank; gloo on CPU, OMP_NUM_THREADS=1; {args.steps} timed steps of batch {args.batch} per run, "
        f"medians of {args.rounds} interleaved rounds, the slower rank's time; torch {torch.__version__}; "
        f"{os.cpu_count()} CPUs; load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print("| training | steps/s | seconds per run (median) |")
    print("|---|---:|---:|")
    without = rows["without"]
    print(f"| without snapshots | {without['steps_per_second']:.2f} | {without['median']:.2f} |")
    print(
        f"| `snapshot_every={args.every}` ({expected} snapshots per run) | "
        f"{rows['with']['steps_per_second']:.2f} | {rows['with']['median']:.2f} |"
    )
    print(
        f"\neach snapshot blocked the step {blocked * 1000:.1f} ms (median; the copy of {own:.1f} MiB "
        "to CPU memory)"
    )
    verdict = "holds" if ratio >= TARGET else "MISSED"
    print(f"\nwith / without: {ratio:.3f}x steps per second, target >= {TARGET}x {verdict}")
    print(f"round by round (median of each round's ratio): {paired:.3f}x")
    if args.json:
        info = {key: getattr(args, key) for key in ("mib", "ranks", "every", "steps", "batch", "rounds")}
        result = {
            **info,
            "own_mib": own,
            "blocked_s": blocked,
            "ratio": ratio,
            "target": TARGET,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
