"""Shard positions and replica sets of a mesh, the plain part of a sharded state dict, and fields kept as
they are when a state dict is applied (no group)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import elastic
from elastic.state.shards import PIECE, allocate_optimizer_state, layout_of, merge_plain, plain_leaves


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> SimpleNamespace:
    return SimpleNamespace(
        mesh=torch.arange(int(torch.tensor(shape).prod())).reshape(shape), mesh_dim_names=names
    )


def test_positions_leave_out_the_replicate_dimension() -> None:
    hsdp = layout_of(mesh((2, 3), ("replicate", "shard")))
    assert hsdp.position == {0: (0,), 1: (1,), 2: (2,), 3: (0,), 4: (1,), 5: (2,)}
    assert hsdp.positions == [(0,), (1,), (2,)]
    assert hsdp.replica_set(4) == [1, 4] and hsdp.replicated
    fsdp = layout_of(mesh((4,), ("shard",)))
    assert fsdp.positions == [(0,), (1,), (2,), (3,)] and fsdp.replica_set(2) == [2] and not fsdp.replicated
    tp = layout_of(mesh((2, 2, 2), ("replicate", "shard", "tp")))
    assert tp.replica_set(3) == [3, 7] and tp.position[3] == (1, 1)
    assert hsdp.describe() == "2x3 mesh ('replicate', 'shard')"


def test_the_plain_part_marks_pieces_and_merges_back_onto_own_pieces() -> None:
    class FakeDTensor(torch.Tensor):
        pass

    import elastic.state.shards as shards

    real = shards.dtensor_type
    shards.dtensor_type = lambda: FakeDTensor  # type: ignore[assignment]
    try:
        piece = torch.zeros(2).as_subclass(FakeDTensor)
        mine = torch.ones(2).as_subclass(FakeDTensor)
        sd = {
            "model": {"w": piece, "buf": torch.tensor([1.0])},
            "step": 3,
            "opt": {"param_groups": [{"lr": 1}]},
        }
        plain = plain_leaves(sd)
        assert plain["model"]["w"] is PIECE and plain["step"] == 3 and plain["opt"] == sd["opt"]
        merged = merge_plain({"model": {"w": mine, "buf": torch.tensor([0.0])}, "step": 1, "opt": {}}, plain)
        assert merged["model"]["w"] is mine  # own piece kept
        assert torch.equal(merged["model"]["buf"], torch.tensor([1.0])) and merged["step"] == 3
    finally:
        shards.dtensor_type = real  # type: ignore[assignment]


@elastic.elastic_state(tenure="step")
class Trained:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


def test_optimizer_states_are_allocated_like_their_parameters_without_a_step() -> None:
    model = torch.nn.Linear(3, 2)
    state = Trained(model=model, optimizer=torch.optim.Adam(model.parameters()))
    entries = {
        ("optimizer", "state", name, key): (
            "torch.float64" if key == "exp_avg_sq" else "torch.float32",
            shape,
        )
        for name, shape in (("weight", (2, 3)), ("bias", (2,)))
        for key in ("exp_avg", "exp_avg_sq")
    }
    assert allocate_optimizer_state(state, {**entries, ("model", "weight"): ("torch.float32", (2, 3))})
    got = {
        (id(p), k): (tuple(t.shape), t.dtype)
        for p, st in state.optimizer.state.items()
        for k, t in st.items()
    }
    assert got == {
        (id(model.weight), "exp_avg"): ((2, 3), torch.float32),
        (id(model.weight), "exp_avg_sq"): ((2, 3), torch.float64),
        (id(model.bias), "exp_avg"): ((2,), torch.float32),
        (id(model.bias), "exp_avg_sq"): ((2,), torch.float64),
    }  # no "step": it comes with the source's objects; no step was taken
    assert all(p.grad is None for p in model.parameters())
    # an entry not shaped like its parameter (a factored moment): nothing allocated, torch's init is needed
    plain = torch.nn.Linear(3, 2)
    other = Trained(model=plain, optimizer=torch.optim.Adam(plain.parameters()))
    assert not allocate_optimizer_state(
        other, {("optimizer", "state", "weight", "row"): ("torch.float32", (2,))}
    )
    assert not other.optimizer.state


def test_importing_elastic_does_not_import_dtensor_or_dcp() -> None:
    code = (
        "import sys, elastic; "
        "print('torch.distributed.tensor' in sys.modules, 'torch.distributed.checkpoint' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_kept_entry_leaves_its_field_as_it_is() -> None:
    import attrs

    import elastic
    from elastic.state.shards import KEEP, apply_sharded

    @elastic.elastic_state(tenure="step")
    @attrs.define
    class Small:
        model: torch.nn.Module
        step: int = 0

    s = Small(model=torch.nn.Linear(2, 2))
    weight = s.model.weight.detach().clone()
    apply_sharded(s, {"model": KEEP, "step": 5})  # a module entry that is not a state dict: not loaded
    assert s.step == 5 and torch.equal(s.model.weight, weight)
    with pytest.raises(ValueError, match="does not match the module"):
        apply_sharded(s, {"model": {}, "step": 6})


def test_a_model_rebuilt_alike_is_named_as_torch_named_the_last_one_without_its_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed.checkpoint.state_dict as torch_sd

    from elastic.state.shards import model_state_dict, optimizer_state_dict

    def built(seed: int, width: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(2, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.ones(4, 2)).sum().backward()
        optim.step()
        return model, optim

    first, first_optim = built(0)
    want_model = torch_sd.get_model_state_dict(first)
    want_optim = torch_sd.get_optimizer_state_dict(first, first_optim)
    assert list(model_state_dict(first)) == list(want_model)
    assert optimizer_state_dict(first, first_optim)["param_groups"] == want_optim["param_groups"]
    walks: list[str] = []

    def counted(name: str) -> Any:
        real = getattr(torch_sd, name)

        def walk(*args: Any, **kwargs: Any) -> Any:
            walks.append(name)
            return real(*args, **kwargs)

        return walk

    for name in ("get_model_state_dict", "get_optimizer_state_dict"):
        monkeypatch.setattr(torch_sd, name, counted(name))
    second, second_optim = built(1)  # other objects, the same structure: torch's names, no walk
    sd, osd = model_state_dict(second), optimizer_state_dict(second, second_optim)
    assert walks == []
    assert list(sd) == list(want_model) and sd["0.weight"].data_ptr() == second[0].weight.data_ptr()
    assert list(osd["state"]) == list(want_optim["state"])
    assert osd["state"]["2.bias"]["exp_avg"] is second_optim.state[second[2].bias]["exp_avg"]
    assert osd["param_groups"] == want_optim["param_groups"]
    wider, _ = built(2, width=4)  # other shapes, the same modules and names: still no walk
    assert list(model_state_dict(wider)) == list(want_model) and walks == []
    third = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    third_optim = torch.optim.Adam(third.parameters(), lr=0.1)
    third(torch.ones(1, 2)).sum().backward()
    third_optim.step()
    model_state_dict(third), optimizer_state_dict(third, third_optim)  # another module type: torch's walk
    assert walks == ["get_model_state_dict", "get_optimizer_state_dict"]
