"""Golden checkpoints: checkpoints written by elastic-state 0.1.0 (format version 1) still load, exactly.

`tests/golden/make_golden.py` wrote them from `golden_state.build()`; here they are loaded into fresh states
(other values, Adam without state) and every value is compared with a new `build()`: tensors bit for bit
(dtype, shape, bytes), plain fields by type and value, objects by equality. A format change must keep these
passing, or bump the format version with a migration (see make_golden.py).
"""

from __future__ import annotations

import shutil
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic
import golden_state

GOLDEN = Path(__file__).parent / "golden" / "v1"


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


def check(state: golden_state.GoldenState, objects: bool, step: int = 1234) -> None:
    """`state` holds every value of `golden_state.build()` (with `step`), bit for bit."""
    want = golden_state.build()
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
        assert state.point == golden_state.Point(x=3, y=-0.25, label="p")
        assert type(state.point) is golden_state.Point
        assert state.ratio == Fraction(22, 7) and type(state.ratio) is Fraction
    else:
        assert state.point is None and state.ratio is None


def test_full_loads_with_trusted(tmp_path: Path) -> None:
    root = tmp_path / "full"
    shutil.copytree(GOLDEN / "full", root)  # a copy: load never writes, but the committed files stay pristine
    state = golden_state.fresh()
    ema_storage = state.ema.data_ptr()
    report = elastic.load(state, root, trusted=True)
    assert report.source == "checkpoint" and report.tenure == 1234
    assert report.path == root / "ckpt-000000001234" and report.saved_world_size == 1
    check(state, objects=True)
    assert state.ema.data_ptr() == ema_storage  # tensors are still loaded in place


def test_full_refused_without_trusted() -> None:
    state = golden_state.fresh()
    with pytest.raises(elastic.UntrustedCheckpointError, match=r"'point', 'ratio'"):
        elastic.load(state, GOLDEN / "full")
    assert state.step == 0 and state.point is None  # untouched


def test_plain_loads_untrusted() -> None:
    state = golden_state.fresh()
    report = elastic.load(state, GOLDEN / "plain" / "ckpt-000000001234")
    assert report.tenure == 1234
    check(state, objects=False)


def test_golden_files_are_small() -> None:
    sizes = [f.stat().st_size for f in GOLDEN.rglob("*") if f.is_file()]
    assert len(sizes) >= 4 and sum(sizes) < 100 * 2**10
