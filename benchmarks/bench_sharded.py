"""Sharded states (FSDP2, HSDP) against plain torch.distributed: `elastic.save`/`load`/`sync` vs DCP and gloo.

The state: an MLP of ``nn.Linear(1024, 1024)`` layers, each under `fully_shard` and the root too, plus
Adam's two moments after one step (``--mib`` in all, default 256: parameters are a third of it), and a
step counter. Four gloo ranks on the CPU (``OMP_NUM_THREADS=1``) hold it on a 2x2 HSDP mesh
(``("replicate", "shard")``): each rank holds half of it, its *pieces*. In every round each variant runs
once, interleaved (the order alternates), after a barrier; a round's time is the slower rank's (the max
over ranks), the table reports medians over rounds (a first warm-up round is dropped) and each row's
ratio to its baseline measured in the same run:

- save: `elastic.save(state, root)` (one writer per shard position, checksums, fsync, manifest last,
  atomic rename) vs ``torch.distributed.checkpoint.save`` of ``{model: get_model_state_dict,
  optimizer: get_optimizer_state_dict, step}`` (DCP's `FileSystemWriter` fsyncs too), each into a fresh
  directory on the same disk every round, after an untimed `os.sync()`;
- load, resharded 4 -> 3: the checkpoint `elastic.save` wrote on the 2x2 mesh, loaded by three ranks (a
  second spawn of a 3-rank world: a 1-D ``("shard",)`` mesh, a fresh FSDP2 model and Adam given one
  step so that its moments exist, as DCP needs) with `elastic.load(state, root)` (verified, staged, in
  place) vs ``dcp.load`` of the same checkpoint directory into ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` followed by ``set_model_state_dict`` / ``set_optimizer_state_dict``.
  Before each load the rank's pieces are perturbed, and after it they are checked against the first
  load's, so that neither can be a no-op;
- sync of a lagging replica set: on the 2x2 mesh, replica index 1 (ranks 2 and 3) is one step behind and
  its values differ (untimed, before each round); `elastic.sync(state)` brings it up (inside each replica
  set the receiver reads its source's pieces straight into its own tensors, by the default transport) vs
  one `dist.broadcast` of a flat buffer of the bytes of one rank's pieces in each rank's
  ``mesh.get_group("replicate")``, both replica sets at once (the floor: no election, no Python per
  tensor).

Peak extra memory: for sync and load (ours and the baseline), each rank's rise of its high-water mark
(VmHWM, reset through ``/proc/self/clear_refs`` before the call) above its RSS before the call, the
worst rank and round, next to the size of the rank's own pieces. The kernel's high-water mark catches
every peak, which a sampling thread could miss, and costs nothing while the call runs (a 1 ms sampler
would take CPU from the four ranks on a small machine).

    python benchmarks/bench_sharded.py                          # 256 MiB, 5 rounds
    python benchmarks/bench_sharded.py --mib 64 --rounds 3 --json sharded.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from bench_sync import reset_high_water, status_kib, trim_heap
from torch import nn
from torch.distributed.tensor import DTensor

import elastic

MiB = 2**20
WIDTH = 1024
TARGETS = {"save": 1.1, "load": 1.1, "sync": 1.3}


@elastic.elastic_state(tenure="step")
@attrs.define
class Sharded:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


def build(mesh: Any, mib: int, seed: int) -> Sharded:
    """The state on `mesh` after one Adam step (the same values on every rank for one `seed`)."""
    from torch.distributed.fsdp import fully_shard

    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 3  # weights and bias, and Adam's two moments, fp32
    layers = max(1, round(mib * MiB / per_layer))
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return Sharded(model=model, optimizer=optimizer, step=1)


def pieces(state: Sharded) -> list[torch.Tensor]:
    """This rank's local tensors of the state's DTensors: parameters and Adam's moments."""
    out = [cast(DTensor, p).to_local() for p in state.model.parameters()]
    for per_param in state.optimizer.state.values():
        out += [cast(DTensor, per_param[k]).to_local() for k in ("exp_avg", "exp_avg_sq")]
    return out


def perturb(state: Sharded) -> None:
    """Change every value of this rank's pieces in place (nothing else)."""
    with torch.no_grad():
        for t in pieces(state):
            t.add_(1.0)


def torch_state_dict(state: Sharded) -> dict[str, Any]:
    """What a DCP user saves and loads: the same keys as `state.state_dict()`."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "model": get_model_state_dict(state.model),
        "optimizer": get_optimizer_state_dict(state.model, state.optimizer),
        "step": state.step,
    }


def measured(fn: Callable[[], Any], memory: bool) -> tuple[float, float]:
    """(seconds from a barrier to the end of `fn` on this rank, this rank's peak extra bytes during it)."""
    gc.collect()
    trim_heap()
    os.sync()  # no call pays for another's writeback
    reset_high_water()
    rss = status_kib("VmRSS")
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, (status_kib("VmHWM") - rss) * 1024.0 if memory else 0.0


def interleaved(
    variants: dict[str, Callable[[int], Callable[[], Any]]],
    rounds: int,
    memory: bool,
    before: Callable[[str], None] = lambda _: None,
    after: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[str, list[float]]]:
    """Each variant once a round, the order alternating; round 0 warms up and is dropped.

    `variants[key](round)` gives the call to time; `before(key)` runs untimed before it, `after(key)`
    untimed after it.
    """
    out: dict[str, dict[str, list[float]]] = {k: {"seconds": [], "peak": []} for k in variants}
    order = list(variants)
    for r in range(rounds + 1):
        for key in order if r % 2 == 0 else order[::-1]:
            call = variants[key](r)
            before(key)
            seconds, peak = measured(call, memory)
            after(key)
            if r > 0:
                out[key]["seconds"].append(seconds)
                out[key]["peak"].append(peak)
    return out


def check(ok: bool, what: str) -> None:
    if not ok:
        msg = f"rank {dist.get_rank()}: {what}"
        raise RuntimeError(msg)


# ---------------------------------------------------------------------------------------------------------
# The two worlds


def four_ranks(rank: int, mib: int, rounds: int, tmp: str) -> dict[str, Any]:
    """Save rows and sync rows on the 2x2 mesh; writes the checkpoint the 3-rank world loads."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    state = build(mesh, mib, seed=0)
    own = sum(t.nbytes for t in pieces(state))
    out: dict[str, Any] = {"own": own}

    def fresh(name: str, r: int) -> str:
        path = f"{tmp}/{name}-{r}"
        if r > 0 and rank == 0:  # the round before's directory, untimed: the disk keeps two at most
            shutil.rmtree(f"{tmp}/{name}-{r - 1}", ignore_errors=True)
        return path

    def ours_save(r: int) -> Callable[[], Any]:
        root = fresh("elastic", r)
        return lambda: elastic.save(state, root)

    def dcp_save(r: int) -> Callable[[], Any]:
        path = fresh("dcp", r)
        return lambda: dcp.save(torch_state_dict(state), checkpoint_id=path)

    out["save"] = interleaved({"elastic": ours_save, "baseline": dcp_save}, rounds, memory=False)
    out["checkpoint"] = str(elastic.save(state, f"{tmp}/for-load"))

    # Sync: replica index 1 lags (one step behind, other values) before every call.
    group = mesh.get_group("replicate")
    lagging = mesh.get_local_rank("replicate") == 1
    flat = torch.ones(own, dtype=torch.uint8)  # touched: no page faults inside the floor
    reports: list[Any] = []

    def lag(key: str) -> None:
        if key == "elastic" and lagging:
            state.step -= 1
            perturb(state)

    variants = {
        "elastic": lambda r: lambda: reports.append(elastic.sync(state)),
        "baseline": lambda r: lambda: dist.broadcast(flat, group=group, group_src=0),
    }
    out["sync"] = interleaved(variants, rounds, memory=True, before=lag)
    moved = [rep.tensor_bytes for rep in reports]  # the pieces of both lagging ranks
    check(all(n >= 2 * own for n in moved), f"a sync moved {moved} bytes, not 2 x {own}")
    elastic.verify(state)  # every replica set holds identical pieces after the last sync
    return out


def three_ranks(rank: int, mib: int, rounds: int, root: str, path: str) -> dict[str, Any]:
    """Load rows: the 2x2 checkpoint onto a 1-D mesh of three ranks."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("shard",))
    state = build(mesh, mib, seed=1)  # other values than the checkpoint's; Adam's moments exist
    own = sum(t.nbytes for t in pieces(state))
    reference: list[torch.Tensor] = []

    def ours() -> None:
        state.step = 0  # the checkpoint (step 1) is more tenured than memory: it is read
        report = elastic.load(state, root)
        check(report.source == "checkpoint" and report.saved_world_size == 4, f"unexpected {report}")

    def plain() -> None:
        state.step = 0
        sd = torch_state_dict(state)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(state.model, sd["model"])
        set_optimizer_state_dict(state.model, state.optimizer, sd["optimizer"])
        state.step = sd["step"]

    def loaded(key: str) -> None:
        now = pieces(state)
        if not reference:
            reference.extend(t.clone() for t in now)
        same = all(torch.equal(a, b) for a, b in zip(reference, now, strict=True))
        check(same and state.step == 1, f"{key} load: the pieces differ from the first load's")

    variants = {"elastic": lambda r: ours, "baseline": lambda r: plain}
    load = interleaved(variants, rounds, memory=True, before=lambda _: perturb(state), after=loaded)
    return {"own": own, "load": load}


def worker(rank: int, world: int, port: int, results: Any, fn: Callable[..., Any], *args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        results.put((rank, fn(rank, *args)))
    finally:
        dist.destroy_process_group()


def on_ranks(world: int, fn: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
    """`fn(rank, *args)` on `world` fresh gloo ranks; their results in rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, port, results, fn, *args), nprocs=world, join=True)
    got = dict(results.get() for _ in range(world))
    return [got[r] for r in range(world)]


# ---------------------------------------------------------------------------------------------------------
# Report


def summary(per_rank: list[dict[str, Any]], row: str) -> dict[str, Any]:
    """Per variant: the slower rank's time per round, its median, the worst rank's peak; the ratio."""
    out: dict[str, Any] = {"own_mib": max(r["own"] for r in per_rank) / MiB}
    for key in ("elastic", "baseline"):
        seconds = [max(ts) for ts in zip(*(r[row][key]["seconds"] for r in per_rank), strict=True)]
        peak = max(max(r[row][key]["peak"]) for r in per_rank)
        out[key] = {"seconds": seconds, "median": statistics.median(seconds), "peak_mib": peak / MiB}
    out["ratio"] = out["elastic"]["median"] / out["baseline"]["median"]
    out["target"] = TARGETS[row]
    return out


LABELS = {
    "save": ("`elastic.save` on 2x2 vs `dcp.save`", "4"),
    "load": ("`elastic.load` 2x2 -> 1x3 (reshard) vs `dcp.load` + `set_state_dict`", "3"),
    "sync": ("`elastic.sync`, replica set 1 lagging vs one flat `broadcast` per replica set", "4"),
}


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| operation | ranks | elastic | baseline | ratio | target | peak extra MiB per rank, "
        "elastic / baseline (own pieces) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row, res in rows.items():
        label, ranks = LABELS[row]
        ours, base = res["elastic"], res["baseline"]
        memory = "" if row == "save" else f"{ours['peak_mib']:.1f} / {base['peak_mib']:.1f} "
        memory += f"({res['own_mib']:.1f})"
        lines.append(
            f"| {label} | {ranks} | {ours['median']:.3f} s | {base['median']:.3f} s | {res['ratio']:.2f}x "
            f"| <= {res['target']}x | {memory} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="state size: parameters and Adam's moments")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (one more warms up)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write the numbers to this file")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # four ranks on a few cores: no OpenMP pools spinning
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        four = on_ranks(4, four_ranks, args.mib, args.rounds, tmp)
        path = four[0]["checkpoint"]
        three = on_ranks(3, three_ranks, args.mib, args.rounds, f"{tmp}/for-load", path)
    rows = {"save": summary(four, "save"), "load": summary(three, "load"), "sync": summary(four, "sync")}
    state_mib = 2 * rows["save"]["own_mib"]
    print(
        f"\nstate: {state_mib:.0f} MiB (FSDP2 MLP + Adam); gloo on CPU, OMP_NUM_THREADS=1; medians of "
        f"{args.rounds} interleaved rounds, the slower rank's time; torch {torch.__version__}; "
        f"{os.cpu_count()} CPUs; load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print(table(rows))
    print()
    for row, res in rows.items():
        verdict = "holds" if res["ratio"] <= res["target"] else "MISSED"
        print(f"{row}: {res['ratio']:.2f}x, target <= {res['target']}x {verdict}")
    if args.json:
        info = {"mib": args.mib, "state_mib": state_mib, "rounds": args.rounds, "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({**info, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
