"""A sharded (HSDP) state saved by 4 workers on a 2x2 mesh, loaded by 3 on a mesh of 3, bit for bit.

The first `elastic.spawn` starts 4 workers on a 2x2 mesh ``("replicate", "shard")``: a small MLP with
`fully_shard` on every Linear and on the root, so its parameters and Adam's states are DTensors (2 shards,
2 replicas of each). They train `--steps` steps and `elastic.save` the state. The second `spawn` starts 3
workers on a mesh ``("shard",)`` of 3, builds the model from other random weights, `elastic.load`s the
checkpoint (resharded: 2 pieces become 3), checks that the model and optimizer, gathered in full, equal
what the first run gathered before saving, bit for bit, and trains `--more` steps.

    python examples/fsdp.py [--steps 4] [--more 2] [--ckpt DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps of the 4 workers, before the save")
    parser.add_argument("--more", type=int, default=2, help="steps of the 3 workers, after the load")
    parser.add_argument("--ckpt", help="an empty checkpoint root (default: a temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        one = elastic.spawn(first, 4, args=(args.ckpt or tmp, args.steps), timeout=120)[0]
        files = " ".join(sorted(p.name for p in one["path"].iterdir()))
        print(f"4 workers, mesh (2, 2) ('replicate', 'shard'): step {one['step']}, loss {one['losses']}")
        print(f"saved {one['path'].name}: {files}; state digest {digest(values(one['full']))}")
        twos = elastic.spawn(second, 3, args=(args.ckpt or tmp, one["full"], args.more), timeout=120)
    two, report = twos[0], twos[0]["report"]
    print(
        f"3 workers, mesh (3,) ('shard',): fresh state digest {two['fresh']}; load: source {report.source}, "
        f"tenure {report.tenure}, saved world size {report.saved_world_size}"
    )
    equal = not any(t["differ"] for t in twos)
    verdict = "equal bit for bit to the saved one" if equal else f"DIFFERS at {two['differ']}"
    print(f"loaded state digest {two['loaded']}: {verdict}")
    print(f"trained on: step {two['step']}, loss {two['losses']}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
