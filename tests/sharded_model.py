"""A small sharded state for the tests: an MLP under FSDP2 (`fully_shard` per layer and on the root), Adam,
a DTensor table sharded on its second dimension (a tensor-parallel placement next to FSDP's), and a step.

`full` gathers the whole state with torch's own `full_state_dict` (every rank gets it), `differences` compares
two gathers bit for bit, `digest` names one by a hash of its bytes. Dimensions are chosen so that shards are
uneven on every mesh of 2-5 ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

import elastic


@elastic.elastic_state(tenure="step")
class Sharded:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    table: Any
    step: int = 0
    note: str = ""


def mesh_for(world: int) -> Any:
    """2x2 HSDP (``("replicate", "shard")``) on 4 ranks, else a 1-D ``("shard",)`` mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    if world == 4:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))


def build(mesh: Any, seed: int = 0) -> Sharded:
    """The state on `mesh`, initialised from `seed` (the same values on every rank for the same seed)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    placements = [Replicate() if n == "replicate" else Shard(1) for n in mesh.mesh_dim_names]
    # no communication: with the same seed every rank cuts its own piece (under elastic.run a builder may
    # run on a newcomer alone, when the mesh stays)
    table = distribute_tensor(torch.randn(3, 5), mesh, placements, src_data_rank=None)
    return Sharded(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), table=table)


def train(state: Sharded, steps: int) -> None:
    """`steps` Adam steps on data that depends on the step only (every rank the same batch)."""
    for _ in range(steps):
        g = torch.Generator().manual_seed(1000 + state.step)
        state.model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        with torch.no_grad():
            state.table._local_tensor.add_(0.5)
        state.step += 1


def full(state: Sharded) -> dict[str, Any]:
    """The whole state, gathered on every rank (model, optimizer, table, step, note)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    return _cloned(
        {
            "model": get_model_state_dict(state.model, options=options),
            "optimizer": get_optimizer_state_dict(state.model, state.optimizer, options=options),
            "table": state.table.full_tensor(),
            "step": state.step,
            "note": state.note,
        }
    )


def _cloned(value: Any) -> Any:
    """Tensors copied (torch returns an optimizer's step counters by reference: they would change later)."""
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value.clone() if isinstance(value, torch.Tensor) else value


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two gathers differ (bit for bit for tensors), as paths."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}.{i}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def digest(gathered: Any) -> str:
    """A short hash of a gather (`full`): keys, tensors' bytes and other values' reprs."""
    h = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                feed(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                feed(v)
        elif isinstance(value, torch.Tensor):
            h.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())

    feed(gathered)
    return h.hexdigest()[:16]


def perturb(state: Sharded, by: float = 1.0) -> None:
    """Change this rank's pieces (parameters, Adam moments, table) in place, nothing else."""
    with torch.no_grad():
        for p in state.model.parameters():
            p._local_tensor.add_(by)
        for st in state.optimizer.state.values():
            st["exp_avg"]._local_tensor.mul_(3.0)
        state.table._local_tensor.add_(by)
