"""Resharding in memory, 4 -> 3 ranks: `hold` + `reshard` against one all-to-all and DCP; kill -> first step.

The state is bench_sharded's (its `build`): an MLP of ``nn.Linear(1024, 1024)`` layers under `fully_shard`
plus Adam's two moments (``--mib`` in all, default 256), on a 2x2 HSDP mesh of four gloo ranks on the CPU
(``OMP_NUM_THREADS=1``). Rank 3 is the one lost: ranks 0-2 form a 1x3 ``("shard",)`` mesh of their own
(a subgroup), and every round, interleaved (the order alternates, a first warm-up round dropped, medians
of the slower rank's time):

- reshard: a state built on the 1x3 mesh as `elastic.run` builds one (meta device, `fully_shard`,
  `to_empty`: no values, no optimizer states), untimed; then, timed, `hold` of the 2x2 state's pieces and
  `reshard` of them into the new state (plan, local copies, reads from the holders' memory, the objects). Its
  pieces are checked against the old state's afterwards (the first round: every tensor's whole value,
  gathered on both meshes; later rounds: equal to the first round's pieces);
- floor: one `all_to_all_single` between ranks 0-2 moving the bytes the reshard moves between the same
  pairs (sizes from the same plan), into buffers allocated and touched beforehand;
- fresh: the same `all_to_all_single` into an output allocated (untimed) just before and never touched,
  as the pieces `build` allocates are: its first writes fault the pages in, as the reshard's do (not a
  target; it shows what first-touch costs on this machine);
- DCP: `dcp.save` of the 2x2 state (``get_model_state_dict``/``get_optimizer_state_dict``, four ranks)
  into ``/dev/shm``, then `dcp.load` of it by ranks 0-2 into a 1x3 state (built with Adam's moments, as
  DCP needs) and ``set_model_state_dict``/``set_optimizer_state_dict``; its pieces must equal the
  reshard's.

Peak extra memory of the reshard, per rank: the rise of VmHWM (reset through ``/proc/self/clear_refs``)
from before the new state is built (the old state alive) to the end of the reshard, so the new state's
pieces count; the bound is the rank's old plus new pieces. The floor and DCP rows: the rise during the
call.

Kill -> first step, under `elastic.run` (`run(fn, build, mesh=...)`, ``spawn(..., restart="worker")``):
four workers on a 2x2 mesh, rank 3 is killed (SIGKILL) after a few steps, `--kills` times (the killed
slot restarts, rejoins, and the mesh is 2x2 again before the next kill), the survivors reshard to 1x3;
and five workers, one a spare: the spare takes the dead member's place, the mesh stays 2x2 (the killed
slot restarts as the next spare). Per kill: from the SIGKILL to the end of the first optimizer step of
the next generation on its slowest member, split into the regroup (kill -> `build` called), `build`,
the fill (`build` returned -> ``fn`` called) and the step.

    python benchmarks/bench_reshard.py                      # 256 MiB, 5 rounds, 3 kills each
    python benchmarks/bench_reshard.py --mib 64 --rounds 3 --kills 2 --json reshard.json
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_sharded import WIDTH, MiB, Sharded, build, check, on_ranks, perturb, pieces, torch_state_dict
from bench_sync import reset_high_water, status_kib, trim_heap
from torch import nn

import elastic
from elastic.replication.collective import Collective
from elastic.replication.comm import Comm
from elastic.replication.reshard import elect_held, hold, plan_moves, region_of, reshard
from elastic.replication.sync import tenure
from elastic.state import shards

TARGETS = {"floor": 1.5, "dcp": 0.5, "kill-reshard": 2.0, "kill-spare": 1.0}
SHM = "/dev/shm"


def build_empty(mesh: Any, mib: int) -> Sharded:
    """The state on `mesh` as `elastic.run`'s builders make it: meta device, `fully_shard`, `to_empty`."""
    from torch.distributed.fsdp import fully_shard

    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 3
    layers = max(1, round(mib * MiB / per_layer))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return Sharded(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))


def wholes(state: Sharded) -> list[torch.Tensor]:
    """Every parameter and moment, whole (collective on the state's mesh)."""
    out = [p.full_tensor() for p in state.model.parameters()]
    for per_param in state.optimizer.state.values():
        out += [per_param[k].full_tensor() for k in ("exp_avg", "exp_avg_sq")]
    return out


def bytes_between(new: Sharded, held: Any, group: Collective) -> tuple[list[int], list[int]]:
    """(bytes this rank sends to each rank, bytes it receives from each) in the reshard of `held` into
    `new`: the plan `reshard` makes, from the same regions."""
    targets = shards.pieces(shards.sharded_state_dict(new))
    wanted = group.gather(tuple(region_of(p) for p in targets), "bench-wanted")
    offers = group.gather((held.offer(),), "bench-held")
    _, holders = elect_held(offers)
    moves = plan_moves(wanted, offers, holders)
    send, recv = [0] * group.world, [0] * group.world
    for m in moves:
        n = torch.Size(m.box[1]).numel() * 4  # fp32 throughout
        if m.src != m.dst and m.src == group.rank:
            send[m.dst] += n
        if m.src != m.dst and m.dst == group.rank:
            recv[m.src] += n
    return send, recv


def rounds_on_four(rank: int, mib: int, rounds: int, tmp: str) -> dict[str, Any]:
    """The reshard, floor and DCP rows on one 4-rank world (rank 3 only saves)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    old = build(mesh, mib, seed=0)
    survivors = [0, 1, 2]
    sub = dist.new_group(survivors)  # every rank creates it; rank 3 is not in it
    mesh3 = DeviceMesh("cpu", survivors, mesh_dim_names=("shard",))
    alive = rank in survivors
    group = Collective(Comm(sub, timedelta(seconds=600), "bench")) if alive else None
    truth = wholes(old)  # the old state's whole values, on every rank
    held = hold(old, tenure(old))
    out: dict[str, Any] = {"old": sum(t.nbytes for t in pieces(old))}
    reference: list[torch.Tensor] = []
    keep: dict[str, Any] = {}

    # The DCP row's target state (Adam's moments exist) and the floor's buffers, from the reshard's plan.
    dcp_state = build(mesh3, mib, seed=1) if alive else None
    if alive:
        probe = build_empty(mesh3, mib)
        reshard(probe, held, group)
        send, recv = bytes_between(probe, held, group)
        out["new"] = sum(t.nbytes for t in pieces(probe))
        out["moved"] = sum(recv)
        out["sent"] = sum(send)
        del probe
        src = torch.ones(sum(send), dtype=torch.uint8)
        dst = torch.ones(sum(recv), dtype=torch.uint8)

    def reshard_call() -> Any:
        if not alive:
            return None
        keep["held"] = hold(old, tenure(old))
        return reshard(keep["new"], keep["held"], group)

    def floor_call() -> Any:
        if alive:
            dist.all_to_all_single(dst, src, recv, send, group=sub)

    def fresh_call() -> Any:
        if alive:
            dist.all_to_all_single(keep["dst"], src, recv, send, group=sub)

    path = f"{tmp}/dcp"

    def dcp_call() -> Any:
        dcp.save(torch_state_dict(old), checkpoint_id=path)
        if alive:
            assert dcp_state is not None
            dcp_state.step = 0
            sd = torch_state_dict(dcp_state)
            dcp.load(sd, checkpoint_id=path, process_group=sub)
            set_model_state_dict(dcp_state.model, sd["model"])
            set_optimizer_state_dict(dcp_state.model, dcp_state.optimizer, sd["optimizer"])
            dcp_state.step = sd["step"]

    def before(key: str) -> int:
        """Untimed set-up; the RSS that the row's peak is measured from."""
        gc.collect()
        trim_heap()
        reset_high_water()
        rss = status_kib("VmRSS")
        if key == "reshard" and alive:
            keep["new"] = build_empty(mesh3, mib)
        if key == "fresh" and alive:
            keep["dst"] = torch.empty(sum(recv), dtype=torch.uint8)
        if key == "dcp" and alive:
            assert dcp_state is not None
            perturb(dcp_state)
        if key != "reshard":
            reset_high_water()
            rss = status_kib("VmRSS")
        return rss

    def after(key: str) -> None:
        if not alive:
            return
        if key == "reshard":
            now = pieces(keep["new"])
            if not reference:
                whole = wholes(keep["new"])
                same = len(whole) == len(truth) and all(torch.equal(a, b) for a, b in zip(whole, truth))
                check(same and keep["new"].step == old.step, "the resharded state differs from the old one")
                reference.extend(t.clone() for t in now)
            check(all(torch.equal(a, b) for a, b in zip(reference, now, strict=True)), "reshard differs")
            keep.clear()
        if key == "fresh":
            keep.clear()
        if key == "dcp":
            assert dcp_state is not None
            same = all(torch.equal(a, b) for a, b in zip(reference, pieces(dcp_state), strict=True))
            check(same and dcp_state.step == old.step, "the DCP load differs from the reshard")
        if key == "dcp" and rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # before the next call's barrier

    calls = {"reshard": reshard_call, "floor": floor_call, "fresh": fresh_call, "dcp": dcp_call}
    order = list(calls)
    results: dict[str, dict[str, list[float]]] = {k: {"seconds": [], "peak": []} for k in calls}
    for r in range(rounds + 1):
        for key in order if r % 2 == 0 else order[::-1]:
            rss = before(key)
            dist.barrier()
            t0 = time.perf_counter()
            calls[key]()
            seconds = time.perf_counter() - t0
            peak = (status_kib("VmHWM") - rss) * 1024.0
            dist.barrier()  # rank 3 waits for the slowest survivor before the next call
            after(key)
            if r > 0:
                results[key]["seconds"].append(seconds)
                results[key]["peak"].append(peak)
    out["rows"] = results
    out["alive"] = alive
    return out


# ---------------------------------------------------------------------------------------------------------
# Kill -> first step under elastic.run


def kill_worker(mib: int, kills: int, steps: int, tmp: str, spare: bool) -> dict[str, Any]:
    """One slot of `elastic.spawn(restart="worker")`: trains under `elastic.run`, rank 3 of a 2x2 mesh
    kills itself after `steps` steps of its generation until `kills` kills happened (files in `tmp`)."""
    from elastic.recovery.rendezvous import read_round
    from elastic.recovery.store import connect, parse_address

    host, port = parse_address(None)
    store = dist.PrefixStore("elastic/elastic/", connect(host, port, timeout=timedelta(seconds=60)))
    torch.set_num_threads(1)
    record: dict[str, Any] = {"builds": {}, "gens": []}

    def killed() -> list[float]:
        return sorted(float(Path(p).read_text()) for p in glob.glob(f"{tmp}/kill-*"))

    def make(world: Any) -> Sharded:
        began = time.time()
        state = build_empty(world.mesh, mib)
        if world.generation == 0:  # nobody holds anything yet: the same values on every replica
            torch.manual_seed(0)
            with torch.no_grad():
                for p in state.model.parameters():
                    p.to_local().normal_(0, 0.02)
        record["builds"][world.generation] = (began, time.time())
        return state

    def fn(state: Sharded, world: Any) -> str:
        entered = time.time()
        seen = len(killed())
        gen = {"generation": world.generation, "size": world.size, "kills": seen, "entered": entered}
        record["gens"].append(gen)
        done = 0
        while True:
            if world.size == 4 and done == steps and seen < kills:
                if spare:  # every member waits until a spare waits in the next round
                    with world.busy("waiting for a spare"):
                        while not read_round(store, world.generation + 1).joined:
                            time.sleep(0.05)
                if world.rank == 3:
                    Path(f"{tmp}/kill-{seen}").write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
            x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(state.step))
            state.model(x).pow(2).mean().backward()
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            state.step += 1
            done += 1
            gen.setdefault("steps", []).append(time.time())
            if done == 1:
                gen["first_step"] = time.time()
            if seen >= kills and done >= 2:
                return "done"
            world.check()

    record["result"] = elastic.run(
        fn, make, mesh=lambda n: (2, 2) if n >= 4 else (n,), min_workers=3, first_workers=4, timeout=60
    )
    record["kills"] = killed()
    return record


def kill_rows(mib: int, kills: int, spare: bool) -> dict[str, Any]:
    """Per kill: SIGKILL -> `build` called, `build`, -> ``fn`` called, first step (slowest member)."""
    with tempfile.TemporaryDirectory() as tmp:
        workers = 5 if spare else 4
        results = elastic.spawn(
            kill_worker,
            workers,
            args=(mib, kills, 3, tmp, spare),
            restart="worker",
            max_restarts=kills,
            timeout=900,
        )
    records = [r for r in results if r is not None]
    times = max((r["kills"] for r in records), key=len)
    check_count = len(times) == kills
    samples = []
    for n, t_kill in enumerate(times):
        # the first generation entered after the kill, by the members that saw it
        entries = [
            (g, r["builds"].get(g["generation"]))
            for r in records
            for g in r["gens"]
            if g["kills"] == n + 1 and g["entered"] > t_kill
        ]
        if not entries:
            continue
        first = min(g["generation"] for g, _ in entries)
        here = [(g, b) for g, b in entries if g["generation"] == first]
        built = [(g, b) for g, b in here if b is not None]  # a member that kept its state built nothing
        samples.append(
            {
                "size": here[0][0]["size"],
                "kept": len(here) - len(built),
                "regroup": max(b[0] for _, b in built) - t_kill
                if built
                else max(g["entered"] for g, _ in here) - t_kill,
                "build": max((b[1] - b[0] for _, b in built), default=0.0),
                "fill": max((g["entered"] - b[1] for g, b in built), default=0.0),
                "step": max(g["first_step"] - g["entered"] for g, _ in here),
                "total": max(g["first_step"] for g, _ in here) - t_kill,
            }
        )
    # a step when nothing changes: the later steps of every generation, between two step ends
    steady = [
        b - a
        for r in records
        for g in r["gens"]
        for a, b in zip(g.get("steps", [])[1:], g.get("steps", [])[2:])
    ]
    sizes = sorted({s["size"] for s in samples})
    return {
        "samples": samples,
        "complete": check_count and len(samples) == kills,
        "sizes": sizes,
        "median": {k: statistics.median(s[k] for s in samples) for k in samples[0]} if samples else {},
        "steady_step": statistics.median(steady) if steady else None,
    }


# ---------------------------------------------------------------------------------------------------------
# Report


def summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    alive = [r for r in per_rank if r["alive"]]
    out: dict[str, Any] = {
        "old_mib": max(r["old"] for r in alive) / MiB,
        "new_mib": max(r["new"] for r in alive) / MiB,
        "moved_mib": sum(r["moved"] for r in alive) / MiB,
        "bound_mib": max(r["old"] + r["new"] for r in alive) / MiB,
    }
    for key in ("reshard", "floor", "fresh", "dcp"):
        ranks = per_rank if key == "dcp" else alive
        seconds = [max(ts) for ts in zip(*(r["rows"][key]["seconds"] for r in ranks), strict=True)]
        peak = max(max(r["rows"][key]["peak"]) for r in ranks)
        out[key] = {"seconds": seconds, "median": statistics.median(seconds), "peak_mib": peak / MiB}
    for key in ("floor", "fresh", "dcp"):
        out[f"ratio_{key}"] = out["reshard"]["median"] / out[key]["median"]
    return out


def table(res: dict[str, Any], kills: dict[str, dict[str, Any]]) -> str:
    r, f, d, fresh = res["reshard"], res["floor"], res["dcp"], res["fresh"]
    lines = [
        "| row | ranks | median | ratio | target | peak extra MiB per rank |",
        "|---|---:|---:|---:|---:|---:|",
        f"| `hold` + `reshard` 2x2 -> 1x3, in memory | 4 -> 3 | {r['median']:.3f} s | | "
        f"| {r['peak_mib']:.1f} (bound: old {res['old_mib']:.1f} + new {res['new_mib']:.1f}) |",
        f"| one `all_to_all_single` of the same bytes ({res['moved_mib']:.1f} MiB) | 3 | {f['median']:.3f} s "
        f"| {res['ratio_floor']:.2f}x | <= {TARGETS['floor']}x | {f['peak_mib']:.1f} |",
        "| the same `all_to_all_single` into buffers allocated just before, untouched (as `build`'s "
        "pieces are) "
        f"| 3 | {fresh['median']:.3f} s | {res['ratio_fresh']:.2f}x | | {fresh['peak_mib']:.1f} |",
        f"| `dcp.save` (2x2) + `dcp.load` (1x3) + `set_state_dict`, /dev/shm | 4 -> 3 | {d['median']:.3f} s "
        f"| {res['ratio_dcp']:.2f}x | <= {TARGETS['dcp']}x | {d['peak_mib']:.1f} |",
    ]
    for key, label in (
        ("kill-reshard", "kill -> first step, 2x2 -> 1x3 resharded"),
        ("kill-spare", "kill -> first step, a spare admitted, 2x2 kept"),
    ):
        k = kills.get(key)
        if not k or not k["median"]:
            continue
        m = k["median"]
        steady = k["steady_step"] or 0.0
        parts = (
            f"regroup {m['regroup']:.2f} + build {m['build']:.2f} + fill {m['fill']:.2f} + first step "
            f"{m['step']:.2f} s; a step otherwise {steady:.2f} s, so {m['total'] - steady:.2f} s beyond one; "
            f"{m['kept']:.0f} members kept their state; training resumes {m['total'] - m['step']:.2f} s "
            "after the kill"
        )
        lines.append(
            f"| {label} ({len(k['samples'])} kills; {parts}) | {'5' if key == 'kill-spare' else '4'} "
            f"| {m['total']:.2f} s | | <= {TARGETS[key]} s | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="state size: parameters and Adam's moments")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (one more warms up)")
    parser.add_argument("--kills", type=int, default=3, help="kills in each elastic.run row (0: none)")
    parser.add_argument("--json", default=None, help="write the numbers to this file")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    here = str(Path(__file__).resolve().parent)  # elastic.spawn's workers import bench_sharded
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=SHM if os.path.isdir(SHM) else None) as tmp:
        four = on_ranks(4, rounds_on_four, args.mib, args.rounds, tmp)
    res = summary(four)
    kills: dict[str, dict[str, Any]] = {}
    if args.kills:
        kills["kill-reshard"] = kill_rows(args.mib, args.kills, spare=False)
        kills["kill-spare"] = kill_rows(args.mib, args.kills, spare=True)
    load_after = os.getloadavg()[0]
    print(
        f"\nstate: {2 * res['old_mib']:.0f} MiB (FSDP2 MLP + Adam) on 2x2, 4 -> 3 ranks; gloo on CPU, "
        f"OMP_NUM_THREADS=1; medians of {args.rounds} interleaved rounds, the slower rank's time; torch "
        f"{torch.__version__}; {os.cpu_count()} CPUs; load {load_before:.1f} before, {load_after:.1f} after\n"
    )
    print(table(res, kills))
    print()
    verdicts = [
        ("reshard / floor", res["ratio_floor"], TARGETS["floor"]),
        ("reshard / DCP", res["ratio_dcp"], TARGETS["dcp"]),
    ]
    print(f"reshard / the floor into untouched buffers: {res['ratio_fresh']:.2f}")
    verdicts += [(key, k["median"]["total"], TARGETS[key]) for key, k in kills.items() if k["median"]]
    for name, value, target in verdicts:
        print(f"{name}: {value:.2f}, target <= {target} {'holds' if value <= target else 'MISSED'}")
    for key, k in kills.items():
        if k["median"]:
            m = k["median"]
            resumes = m["total"] - m["step"]
            print(f"{key}: training resumes {resumes:.2f} s after the kill (its first step begins)")
    print(
        f"peak extra of the reshard: {res['reshard']['peak_mib']:.1f} MiB, bound {res['bound_mib']:.1f} MiB"
    )
    for key, k in kills.items():
        if not k["complete"] or k["sizes"] != ([3] if key == "kill-reshard" else [4]):
            print(
                f"{key}: {len(k['samples'])} samples, generation sizes after a kill {k['sizes']} (unexpected)"
            )
    if args.json:
        info = {"mib": args.mib, "rounds": args.rounds, "torch": torch.__version__, "cpus": os.cpu_count()}
        Path(args.json).write_text(json.dumps({**info, "reshard": res, "kills": kills}, indent=2) + "\n")


if __name__ == "__main__":
    main()
