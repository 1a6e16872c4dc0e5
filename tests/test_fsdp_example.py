"""examples/fsdp.py, the sharded-state example, one subprocess run per demo; the assertions read what it
prints.

- ``--demo save-load``: 4 workers train an HSDP state on a 2x2 mesh and save it, 3 workers load it onto a
  mesh of 3 and train on. Checked: the losses, the checkpoint's files, the load's report, digests of the
  whole model and optimizer gathered in full, and the checkpoint it leaves, which plain
  `torch.distributed.checkpoint.load` reads back here, in one process with no process group.
- ``--demo in-process``: 4 workers under ``elastic.run(fn, build, mesh=...)``, one killed; checked: the
  meshes 2x2 -> 3 -> 2x2, each generation starting from the state of the last step bit for bit, at most
  one step lost, the replacement's life, the same final state on every worker.
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
KILL_AT, UNTIL = 5, 12

TRAINED = re.compile(r"^4 workers, mesh \(2, 2\) \('replicate', 'shard'\): step (\d+), loss (.+)$", re.M)
SAVED = re.compile(r"^saved (\S+): (.+); state digest ([0-9a-f]{12})$", re.M)
LOADED = re.compile(
    r"^3 workers, mesh \(3,\) \('shard',\): fresh state digest ([0-9a-f]{12}); load: source (\w+), "
    r"tenure (\d+), saved world size (\d+)$",
    re.M,
)
EQUAL = re.compile(r"^loaded state digest ([0-9a-f]{12}): (.+)$", re.M)
MORE_LINE = re.compile(r"^trained on: step (\d+), loss (.+)$", re.M)

GENERATION = re.compile(
    r"^generation (\d+): (\d) workers, mesh \(([\d, ]+)\) \(([^)]*)\), from step (\d+) at ([\d.]+) s(.*)$",
    re.M,
)
KILLED = re.compile(r"^worker 3 killed \(SIGKILL\) after step (\d+), at ([\d.]+) s$", re.M)
FIGURES = re.compile(
    r"^kill -> first step of the survivors: ([\d.]+) s \(regrouped and resharded in ([\d.]+) s\); "
    r"steps lost: (\d+)$",
    re.M,
)
FINISHED = re.compile(r"^finished at step (\d+), state digest by slot: ((?:[0-9a-f]{12} ?){4}): (.+)$", re.M)


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


def run_example(cwd: Path, *args: str) -> str:
    """The example's output (stdout and stderr), after it exited with 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], cwd=cwd, capture_output=True, text=True, timeout=200, env=env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.mark.timeout(240)
def test_fsdp_example_saves_hsdp_on_2x2_and_loads_onto_3_bit_for_bit(tmp_path: Path) -> None:
    out = run_example(
        tmp_path, "--demo", "save-load", "--steps", str(STEPS), "--more", str(MORE), "--ckpt", "ckpt"
    )
    assert "in process:" not in out  # only the demo asked for

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


@pytest.mark.timeout(240)
def test_fsdp_example_in_process_reshards_a_lost_worker_in_memory_and_rejoins(tmp_path: Path) -> None:
    out = run_example(tmp_path, "--demo", "in-process", "--kill-at", str(KILL_AT), "--until", str(UNTIL))
    assert "saved ckpt-" not in out  # only the demo asked for
    assert list(tmp_path.iterdir()) == []  # no checkpoint anywhere: the reshard is in memory

    # Slot 0's generations: 2x2 HSDP, then 1-D of 3 once worker 3 is gone, then 2x2 again with its
    # replacement; generation numbers increasing, times too.
    gens = GENERATION.findall(out)
    shapes = [
        (int(size), tuple(int(d) for d in mesh.split(",") if d.strip()), names)
        for _, size, mesh, names, *_ in gens
    ]
    assert shapes == [
        (4, (2, 2), "'replicate', 'shard'"),
        (3, (3,), "'shard',"),
        (4, (2, 2), "'replicate', 'shard'"),
    ], out
    numbers, starts, times = (
        [int(g[0]) for g in gens],
        [int(g[4]) for g in gens],
        [float(g[5]) for g in gens],
    )
    assert numbers == sorted(set(numbers)) and times == sorted(times) and starts[0] == 0, out
    [(killed, kill_time)] = KILLED.findall(out)
    assert int(killed) == KILL_AT and times[0] < float(kill_time) < times[1], out
    assert f"[rank 3] killing this worker (SIGKILL) after step {KILL_AT}" in out
    assert "restarting slot 3 (restart 1 of 1)" in out

    # The survivors went on from the last step they completed (at most the step in flight lost), their
    # state on the mesh of 3 bit for bit the one they had gathered on 2x2 after that step; the replacement
    # joined later, on 2x2, and received the survivors' state bit for bit.
    [(first_step, regroup, lost)] = FIGURES.findall(out)
    assert int(lost) == KILL_AT - starts[1] and int(lost) <= 1, out
    assert float(regroup) <= float(first_step), out
    assert gens[1][6] == f": the state equal bit for bit to step {starts[1]} before", out
    assert starts[2] > starts[1] and gens[2][6] == (
        f": the state equal bit for bit to step {starts[2]} before; the replacement received it bit for bit"
    ), out
    joined = rf"^\[rank 3\] slot 3 life 1: generation {numbers[2]}, rank 3 of 4, mesh \(2, 2\), from step "
    joined += rf"{starts[2]}$"
    assert re.search(joined, out, re.M), out

    # Every worker, the replacement included, ends with the same whole state, at step UNTIL or later.
    [(step, finals, verdict)] = FINISHED.findall(out)
    assert int(step) >= UNTIL and len(set(finals.split())) == 1 and verdict == "the same on every worker", out
