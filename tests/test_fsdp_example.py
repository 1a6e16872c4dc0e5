"""examples/fsdp.py, the sharded-state example: 4 workers train an HSDP state on a 2x2 mesh and save it, 3
workers load it onto a mesh of 3 and train on.

One subprocess run; the assertions read what it prints (the losses, the checkpoint's files, the load's
report, digests of the whole model and optimizer gathered in full) and the checkpoint it leaves, which plain
`torch.distributed.checkpoint.load` reads back here, in one process with no process group.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from example_module import load_example

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fsdp.py"
STEPS, MORE = 4, 2

TRAINED = re.compile(r"^4 workers, mesh \(2, 2\) \('replicate', 'shard'\): step (\d+), loss (.+)$", re.M)
SAVED = re.compile(r"^saved (\S+): (.+); state digest ([0-9a-f]{12})$", re.M)
LOADED = re.compile(
    r"^3 workers, mesh \(3,\) \('shard',\): fresh state digest ([0-9a-f]{12}); load: source (\w+), "
    r"tenure (\d+), saved world size (\d+)$",
    re.M,
)
EQUAL = re.compile(r"^loaded state digest ([0-9a-f]{12}): (.+)$", re.M)
MORE_LINE = re.compile(r"^trained on: step (\d+), loss (.+)$", re.M)


def example() -> ModuleType:
    """The example as a module, for its model and its digest."""
    return load_example(EXAMPLE, "fsdp_example")


def losses(text: str) -> list[float]:
    return [float(x) for x in text.split(" -> ")]


def plain_dcp_digest(fsdp: ModuleType, checkpoint: Path) -> str:
    """The checkpoint's model and optimizer read by plain DCP into an unsharded model, digested as the
    example digests the full state it gathered before saving."""
    model = fsdp.mlp()
    optimizer = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # DCP fills only what exists: Adam's states must be there
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": it is one
        dcp.load(state, checkpoint_id=checkpoint)
    digest: str = fsdp.digest(fsdp.values(state))
    return digest


@pytest.mark.timeout(240)
def test_fsdp_example_saves_hsdp_on_2x2_and_loads_onto_3_bit_for_bit(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--more", str(MORE), "--ckpt", "ckpt"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out

    # The 4 workers trained STEPS steps and learnt.
    [(step, before)] = TRAINED.findall(out)
    assert int(step) == STEPS and len(losses(before)) == STEPS and losses(before)[-1] < losses(before)[0], out

    # One checkpoint, at the tenure, in DCP's format with elastic's manifest; nothing else left in the root.
    [(name, files, saved)] = SAVED.findall(out)
    assert name == f"ckpt-{STEPS:012d}", out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [name]
    listed = files.split()
    assert listed == sorted(p.name for p in (tmp_path / "ckpt" / name).iterdir()), out
    assert {".metadata", "manifest.json"} <= set(listed), out
    assert [f for f in listed if re.fullmatch(r"__\d+_0\.distcp", f)], out

    # The 3 workers started from other weights, read the checkpoint (not their memory) at its tenure.
    [(fresh, source, tenure, saved_world)] = LOADED.findall(out)
    assert fresh != saved, out
    assert (source, int(tenure), int(saved_world)) == ("checkpoint", STEPS, 4), out
    # After the load, the model and Adam gathered in full are the saved ones, bit for bit, on every rank.
    [(loaded, verdict)] = EQUAL.findall(out)
    assert loaded == saved and verdict == "equal bit for bit to the saved one", out

    # They trained on from there: the tenure goes on, the loss goes on from where the 4 workers left it.
    [(step, after)] = MORE_LINE.findall(out)
    assert int(step) == STEPS + MORE and len(losses(after)) == MORE, out
    assert losses(after)[0] < losses(before)[0] / 2, out

    # Plain DCP reads the checkpoint, in one process, into an unsharded model: the same values again.
    assert plain_dcp_digest(example(), tmp_path / "ckpt" / name) == saved
