"""The state of the golden checkpoints (`tests/golden/`), built deterministically.

`build()` makes the state that `tests/golden/make_golden.py` saved; `tests/checkpoint/test_golden.py`
builds it again to know every expected value, and `fresh()` builds the differently-valued state the
checkpoints are loaded into. Every value is set from exact arithmetic (`torch.arange` scaled by powers of
two, literal numbers), not from training, so the expectations do not depend on the torch version's
kernels.

The classes are imported by reference from this module (``golden_state.Point``), never pickled by value:
a by-value pickle holds Python bytecode, which does not load in another Python version.
"""

from __future__ import annotations

import warnings
from fractions import Fraction
from typing import Any

import attrs
import torch

import elastic


@attrs.define(eq=True)
class Point:
    """A custom class: stored in objects.pkl, so loading it needs trusted=True."""

    x: int
    y: float
    label: str


@elastic.elastic_state(tenure="step")
@attrs.define
class GoldenState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: int = 0
    loss: float = 0.0
    name: str = ""
    nothing: Any = None
    history: list[Any] = attrs.Factory(list)
    config: dict[str, Any] = attrs.Factory(dict)
    pair: tuple[int, str] = (0, "")
    tags: set[str] = attrs.Factory(set)
    blob: bytes = b""
    ema: torch.Tensor = attrs.field(factory=lambda: torch.zeros(5, dtype=torch.float64))
    counts: torch.Tensor = attrs.field(factory=lambda: torch.zeros(2, 3, dtype=torch.int64))
    half: torch.Tensor = attrs.field(factory=lambda: torch.zeros(4, dtype=torch.bfloat16))
    point: Any = None
    ratio: Any = None


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


def ramp(
    shape: tuple[int, ...], scale: float, offset: float = 0.0, dtype: Any = torch.float32
) -> torch.Tensor:
    """Exact values: 0, 1, 2, ... times `scale` (a power of two) plus `offset`, in `shape`."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64) * scale + offset).reshape(shape).to(dtype)


def build() -> GoldenState:
    """The saved state: a module, Adam with state, StepLR stepped 3 times, plain and object fields."""
    model = _model()
    with torch.no_grad():
        for k, (_name, tensor) in enumerate(model.state_dict().items()):
            if tensor.dtype.is_floating_point:
                tensor.copy_(ramp(tuple(tensor.shape), 2.0**-3, offset=k - 2.0))
            else:
                tensor.fill_(7)  # num_batches_tracked
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.75), eps=2.0**-20)
    params = list(model.parameters())
    saved = optimizer.state_dict()
    saved["state"] = {
        i: {
            "step": torch.tensor(3.0),
            "exp_avg": ramp(tuple(p.shape), 2.0**-5, offset=-1.0 - i),
            "exp_avg_sq": ramp(tuple(p.shape), 2.0**-6, offset=0.5 + i),
        }
        for i, p in enumerate(params)
    }
    optimizer.load_state_dict(saved)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    with warnings.catch_warnings():  # stepped without optimizer.step(): the parameters stay exact
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(3):
            scheduler.step()
    return GoldenState(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        step=1234,
        loss=0.1,
        name="golden ü",
        nothing=None,
        history=[1, 2.5, "three", None, [4, [5.0, "six"]], {"seven": 8}, True],
        config={"lr": 0.01, "layers": [4, 3], "nested": {"a": None, "b": [1, 2], "c": {"d": -1.5e-300}}},
        pair=(9, "ten"),
        tags={"x", "y", "z"},
        blob=b"\x00\x01\xfe\xff",
        ema=ramp((5,), 0.25, offset=-0.5, dtype=torch.float64),
        counts=torch.arange(6, dtype=torch.int64).reshape(2, 3) * (2**40),
        half=ramp((4,), 0.5, dtype=torch.bfloat16),
        point=Point(x=3, y=-0.25, label="p"),
        ratio=Fraction(22, 7),
    )


def fresh(with_objects: bool = True) -> GoldenState:
    """The state a golden checkpoint is loaded into: same structure, other values, Adam without state."""
    torch.manual_seed(1)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    state = GoldenState(model=model, optimizer=optimizer, scheduler=scheduler)
    if not with_objects:
        state.point = None
        state.ratio = None
    return state


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


def same_value(a: Any, b: Any) -> None:
    """Equal with the same types all the way down (1 == 1.0 == True is not enough)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        same_tensor(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same_value(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same_value(x, y)
    else:
        assert a == b, (a, b)


def check(state: GoldenState, objects: bool, step: int = 1234) -> None:
    """`state` holds every value of `build()` (with `step`), bit for bit."""
    want = build()
    want.step = step
    for (ka, a), (kb, b) in zip(state.model.state_dict().items(), want.model.state_dict().items()):
        assert ka == kb
        same_tensor(a, b)
    got_opt, want_opt = state.optimizer.state_dict(), want.optimizer.state_dict()
    same_value(got_opt["param_groups"], want_opt["param_groups"])
    assert sorted(got_opt["state"]) == sorted(want_opt["state"]) == [0, 1, 2, 3]
    for i in want_opt["state"]:
        same_value(got_opt["state"][i], want_opt["state"][i])
    assert state.optimizer.param_groups[0]["lr"] == 0.005  # 0.01 halved at epoch 2 by StepLR
    sched, want_sched = state.scheduler, want.scheduler
    assert (sched.last_epoch, sched.step_size, sched.gamma) == (3, 2, 0.5)
    same_value(sched.base_lrs, want_sched.base_lrs)
    same_value(sched.get_last_lr(), want_sched.get_last_lr())
    assert sched.optimizer is state.optimizer  # the scheduler still drives the live optimizer
    for name in ("step", "loss", "name", "nothing", "history", "config", "pair", "tags", "blob"):
        same_value(getattr(state, name), getattr(want, name))
    for name in ("ema", "counts", "half"):
        same_tensor(getattr(state, name), getattr(want, name))
    if objects:
        assert state.point == Point(x=3, y=-0.25, label="p")
        assert type(state.point) is Point
        assert state.ratio == Fraction(22, 7) and type(state.ratio) is Fraction
    else:
        assert state.point is None and state.ratio is None
