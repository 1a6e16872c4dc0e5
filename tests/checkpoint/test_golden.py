"""Golden checkpoints: checkpoints written by elastic-state 0.1.0 (format version 1) still load, exactly.

`tests/golden/make_golden.py` wrote them from `golden_state.build()`; here they are loaded into fresh states
(other values, Adam without state) and every value is compared with a new `build()`: tensors bit for bit
(dtype, shape, bytes), plain fields by type and value, objects by equality. A format change must keep these
passing, or bump the format version with a migration (see make_golden.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import elastic
import golden_state
from golden_state import check

GOLDEN = Path(__file__).parents[1] / "golden" / "v1"


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


def test_a_save_names_the_kinds_the_golden_manifests_name(tmp_path: Path) -> None:
    path = elastic.save(golden_state.build(), tmp_path, keep=None)
    fields = json.loads((path / "manifest.json").read_text())["fields"]
    golden = json.loads((GOLDEN / "full" / "ckpt-000000001234" / "manifest.json").read_text())["fields"]
    assert fields == golden and {f["kind"] for f in fields} >= {"module", "optimizer", "stateful", "tensor"}
