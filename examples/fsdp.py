"""A sharded (HSDP) state across a change of world: through a checkpoint, and in memory under `elastic.run`.

``--demo save-load``: the first `elastic.spawn` starts 4 workers on a 2x2 mesh ``("replicate", "shard")``:
a small MLP with `fully_shard` on every Linear and on the root, so its parameters and Adam's states are
DTensors (2 shards, 2 replicas of each). They train `--steps` steps and `elastic.save` the state. The second
`spawn` starts 3 workers on a mesh ``("shard",)`` of 3, builds the model from other random weights,
`elastic.load`s the checkpoint (resharded: 2 pieces become 3), checks that the model and optimizer, gathered
in full, equal what the first run gathered before saving, bit for bit, and trains `--more` steps.

``--demo in-process``: 4 workers under ``elastic.spawn(..., restart="worker")`` run
``elastic.run(fn, build, mesh=...)``: a 2x2 mesh for 4 workers, a 1-D mesh of 3 for 3. Worker 3 kills
itself (SIGKILL) after step `--kill-at`; the 3 survivors regroup, `build` makes the state on a mesh of 3
and it is filled in memory from their pieces (no disk), bit for bit the state of the last step; they train
on; `spawn` restarts worker 3, which joins at their next `world.check()`, and the mesh is 2x2 again. They
stop at step `--until` or later, once 2x2 again, and every worker holds the same state.

    python examples/fsdp.py [--demo both|save-load|in-process] [--steps 4] [--more 2] [--ckpt DIR]
                            [--kill-at 6] [--until 16]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import os
import signal
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import elastic

IN, HIDDEN, OUT, BATCH = 8, 32, 4, 16
TARGET = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(0))  # the map the MLP learns


@elastic.elastic_state(tenure="step")
@attrs.define
class TrainState:
    model: nn.Module  # its parameters are DTensors on the state's mesh
    optimizer: torch.optim.Optimizer  # and so are Adam's exp_avg and exp_avg_sq
    step: int = 0  # a plain field: replicated on every rank


def mlp() -> nn.Sequential:  # the last layer has 4 rows: on a mesh of 3, one rank holds none of them
    layers = [nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)]
    return nn.Sequential(*layers)


def build(mesh: DeviceMesh, seed: int) -> TrainState:
    torch.manual_seed(seed)  # the same weights on every rank before sharding
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return TrainState(model, torch.optim.Adam(model.parameters(), lr=3e-2))


def train(state: TrainState, steps: int) -> str:
    """`steps` steps, each rank on its own batch (all are data-parallel ranks); the losses, averaged."""
    losses = []
    for _ in range(steps):
        data = torch.Generator().manual_seed(1000 * state.step + dist.get_rank())
        x = torch.randn(BATCH, IN, generator=data)
        loss = F.mse_loss(state.model(x), x @ TARGET)
        loss.backward()  # FSDP reduce-scatters the gradients, and all-reduces them across replicas
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(f"{mean.item() / dist.get_world_size():.4f}")
    return " -> ".join(losses)


def full_state(state: TrainState) -> dict[str, Any]:
    """The whole model and optimizer on every rank (collective): what one process alone would hold."""
    full = StateDictOptions(full_state_dict=True)
    optimizer = get_optimizer_state_dict(state.model, state.optimizer, options=full)
    return {"model": get_model_state_dict(state.model, options=full), "optimizer": optimizer}


def values(tree: Any, path: str = "") -> dict[str, bytes]:
    """Every leaf of a state dict by its path, as its exact bytes (a tensor's dtype, shape and data)."""
    if isinstance(tree, (dict, list, tuple)):
        items = sorted(tree.items(), key=str) if isinstance(tree, dict) else enumerate(tree)
        return {k: v for key, value in items for k, v in values(value, f"{path}/{key}").items()}
    if isinstance(tree, torch.Tensor):
        data = bytes(tree.detach().contiguous().reshape(-1).view(torch.uint8).tolist())  # no NumPy needed
        return {path: f"{tree.dtype}{tuple(tree.shape)}".encode() + data}
    return {path: repr(tree).encode()}


def digest(leaves: dict[str, bytes]) -> str:
    joined = b"".join(k.encode() + b"\0" + v for k, v in sorted(leaves.items()))
    return hashlib.sha256(joined).hexdigest()[:12]


def first(root: str, steps: int) -> dict[str, Any]:
    state = build(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), seed=0)
    losses = train(state, steps)
    elastic.verify(state)  # the two replicas of each shard hold the same pieces
    full = full_state(state)
    path = elastic.save(state, root)  # one writer per shard: DCP's files, then elastic's manifest.json
    return {"full": full, "losses": losses, "path": Path(path), "step": state.step}


def second(root: str, saved: dict[str, Any], steps: int) -> dict[str, Any]:
    state = build(init_device_mesh("cpu", (3,), mesh_dim_names=("shard",)), seed=1)  # other weights
    fresh = digest(values(full_state(state)))
    report = elastic.load(state, root)  # the checkpoint is more tenured than this step 0: read, resharded
    loaded, want = values(full_state(state)), values(saved)
    differ = sorted(k for k in loaded.keys() | want.keys() if loaded.get(k) != want.get(k))
    result = {"report": report, "fresh": fresh, "loaded": digest(loaded), "differ": differ}
    return {**result, "losses": train(state, steps), "step": state.step}  # left to right: step after


PAUSE = 0.1  # seconds after each step: a tiny MLP steps in milliseconds; this makes the timeline readable


def hsdp_or_flat(n: int) -> tuple[int, ...]:
    """The mesh for `n` live workers: 2x2 HSDP for 4, else one shard per worker (FSDP)."""
    return (2, 2) if n == 4 else (n,)


def run_worker(root: str, kill_at: int, until: int) -> dict[str, Any]:
    """One worker of the in-process demo (a `spawn` slot, any of its lives): ``elastic.run`` with a builder.

    Returns what it saw: each generation it took part in (number, size, mesh, the step it started at, when,
    the digest of the whole state then and, for a survivor, the digest it had gathered after that step in
    the generation before), each step it completed (when, the world size) and the final digest. The worker
    in slot 3 kills itself after step `kill_at`, in its first life, writing when into ``root/killed``; its
    replacement waits for ``root/three`` (the survivors have trained 3 steps as 3) before it joins, so that
    the generation of 3 shows.
    """
    slot, life = int(os.environ["ELASTIC_SLOT"]), int(os.environ["ELASTIC_SLOT_RESTARTS"])
    record: dict[str, Any] = {"slot": slot, "life": life, "generations": [], "steps": []}
    killed, three = Path(root) / "killed", Path(root) / "three"
    gathered: deque[tuple[int, dict[str, Any]]] = deque(maxlen=2)  # the whole state after the last 2 steps

    def fn(state: TrainState, world: elastic.World) -> str:
        entered, shape = time.time(), tuple(world.mesh.mesh.shape)
        before = {step: digest(values(full)) for step, full in gathered}.get(state.step)
        now = digest(values(full_state(state)))  # collective, as every gather
        record["generations"].append(
            {
                "generation": world.generation,
                "size": world.size,
                "mesh": shape,
                "names": world.mesh.mesh_dim_names,
                "step": state.step,
                "time": entered,
                "digest": now,
                "before": before,
            }
        )
        print(
            f"slot {slot} life {life}: generation {world.generation}, rank {world.rank} of {world.size}, "
            f"mesh {shape}, from step {state.step}",
            flush=True,
        )
        ran = 0  # steps in this generation
        while not (state.step >= until and world.size == 4 and ran >= 2):
            if (slot, life) == (3, 0) and state.step == kill_at:
                killed.write_text(f"{time.time()} {state.step}")
                print(f"killing this worker (SIGKILL) after step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            train(state, 1)
            ran += 1
            record["steps"].append((time.time(), state.step, world.size))
            gathered.append((state.step, copy.deepcopy(full_state(state))))  # a copy: Adam's steps are live
            if world.size == 3 and ran == 3:
                three.touch()
            time.sleep(PAUSE)
            world.check()  # a worker waiting to join ends the generation here, on every rank
        return digest(values(full_state(state)))

    if life > 0:  # the replacement: started by spawn once the first life died
        deadline = time.monotonic() + 120
        while not three.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    record["final"] = elastic.run(
        fn,
        lambda world: build(world.mesh, seed=0),  # every generation: the state on its mesh, then filled
        mesh=hsdp_or_flat,
        min_workers=3,
        first_workers=4,
        timeout=5,
    )
    return record


def in_process(kill_at: int = 6, until: int = 16) -> dict[str, Any]:
    """The in-process demo: 4 workers, one killed and replaced; what they saw, put together.

    Returns ``workers`` (each slot's record from `run_worker`, its last life), ``kill`` (when, after which
    step), ``start`` (the time every other time is counted from: generation 0's start on slot 0),
    ``spawned`` (when `spawn` was called),
    ``generations`` (slot 0's; all but the first with ``equal``: whether the state it started from is bit
    for bit the one it had after that step; the replacement's first one also with ``joiner_equal``:
    whether what it received is bit for bit slot 0's), ``first_step`` (seconds from the kill to the
    survivors' first step), ``regroup`` (seconds from the kill to the start of their generation), ``lost``
    (completed steps the survivors did again) and ``finals`` (each worker's final digest).
    """
    spawned = time.time()
    with tempfile.TemporaryDirectory() as root:
        workers = elastic.spawn(
            run_worker, 4, args=(root, kill_at, until), restart="worker", max_restarts=1, timeout=240
        )
        kill_time, kill_step = (Path(root) / "killed").read_text().split()
    survivor, joiner = workers[0], workers[3]
    kill = {"time": float(kill_time), "step": int(kill_step)}
    gens = [dict(g) for g in survivor["generations"]]
    for g in gens[1:]:
        g["equal"] = g["digest"] == g["before"]
    joined = joiner["generations"][0]
    rejoined = next(g for g in gens if g["generation"] == joined["generation"])
    rejoined["joiner_equal"] = joined["digest"] == rejoined["digest"]
    after = [t for t, _, _ in survivor["steps"] if t > kill["time"]]
    before = [step for t, step, _ in survivor["steps"] if t < kill["time"]]
    resumed = next(g for g in gens if g["time"] > kill["time"])
    return {
        "workers": workers,
        "kill": kill,
        "start": gens[0]["time"],
        "spawned": spawned,
        "generations": gens,
        "first_step": after[0] - kill["time"],
        "regroup": resumed["time"] - kill["time"],
        "lost": max(before) - resumed["step"],
        "finals": [w["final"] for w in workers],
    }


def report(result: dict[str, Any]) -> list[str]:
    """What `in_process` saw, as the lines the example prints."""
    t0, kill = result["start"], result["kill"]
    lines = []
    for i, g in enumerate(result["generations"]):
        line = (
            f"generation {g['generation']}: {g['size']} workers, mesh {g['mesh']} {g['names']}, "
            f"from step {g['step']} at {g['time'] - t0:.2f} s"
        )
        if i == 0:
            lines.append(line)
            lines.append(f"worker 3 killed (SIGKILL) after step {kill['step']}, at {kill['time'] - t0:.2f} s")
            continue
        same = "equal bit for bit" if g["equal"] else "DIFFERENT from"
        line += f": the state {same} to step {g['step']} before"
        if "joiner_equal" in g:
            line += f"; the replacement received it {'bit for bit' if g['joiner_equal'] else 'DIFFERENT'}"
        lines.append(line)
    finals = result["finals"]
    lines.append(
        f"kill -> first step of the survivors: {result['first_step']:.2f} s (regrouped and resharded in "
        f"{result['regroup']:.2f} s); steps lost: {result['lost']}"
    )
    verdict = "the same on every worker" if len(set(finals)) == 1 else "DIFFERENT"
    step = result["workers"][0]["steps"][-1][1]
    lines.append(f"finished at step {step}, state digest by slot: {' '.join(finals)}: {verdict}")
    return lines


def checkpoint_demo(steps: int, more: int, ckpt: str | None) -> bool:
    """The save-load demo; whether the loaded state equals the saved one on every rank."""
    with tempfile.TemporaryDirectory() as tmp:
        one = elastic.spawn(first, 4, args=(ckpt or tmp, steps), timeout=120)[0]
        files = " ".join(sorted(p.name for p in one["path"].iterdir()))
        print(f"4 workers, mesh (2, 2) ('replicate', 'shard'): step {one['step']}, loss {one['losses']}")
        print(f"saved {one['path'].name}: {files}; state digest {digest(values(one['full']))}")
        twos = elastic.spawn(second, 3, args=(ckpt or tmp, one["full"], more), timeout=120)
    two, load = twos[0], twos[0]["report"]
    print(
        f"3 workers, mesh (3,) ('shard',): fresh state digest {two['fresh']}; load: source {load.source}, "
        f"tenure {load.tenure}, saved world size {load.saved_world_size}"
    )
    equal = not any(t["differ"] for t in twos)
    verdict = "equal bit for bit to the saved one" if equal else f"DIFFERS at {two['differ']}"
    print(f"loaded state digest {two['loaded']}: {verdict}")
    print(f"trained on: step {two['step']}, loss {two['losses']}")
    return equal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--demo", choices=("both", "save-load", "in-process"), default="both")
    parser.add_argument(
        "--steps", type=int, default=4, help="save-load: steps of the 4 workers, before the save"
    )
    parser.add_argument(
        "--more", type=int, default=2, help="save-load: steps of the 3 workers, after the load"
    )
    parser.add_argument("--ckpt", help="save-load: an empty checkpoint root (default: a temporary directory)")
    parser.add_argument(
        "--kill-at", type=int, default=6, help="in-process: worker 3 is killed after this step"
    )
    parser.add_argument("--until", type=int, default=16, help="in-process: the last step, at least")
    args = parser.parse_args(argv)
    ok = True
    if args.demo in ("both", "save-load"):
        ok = checkpoint_demo(args.steps, args.more, args.ckpt)
    if args.demo in ("both", "in-process"):
        started = time.time()
        result = in_process(args.kill_at, args.until)
        print(
            f'in process: 4 workers under elastic.spawn(restart="worker") running elastic.run(fn, build, '
            f"mesh=hsdp_or_flat): {time.time() - started:.1f} s, generation 0 starting "
            f"{result['start'] - result['spawned']:.1f} s after the spawn"
        )
        print("\n".join(report(result)))
        gens = result["generations"]
        ok = ok and len(set(result["finals"])) == 1 and all(g["equal"] for g in gens[1:])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
