"""examples/gpt.py, the nanoGPT-style example: three workers, one killed in the middle of a step's gradient
accumulation, restarted in its slot, rejoining.

One subprocess run (30 steps, the kill at step 10, an evaluation and a checkpoint every 10 steps); the
assertions read what the example prints: each slot's closing line (its final step, the optimizer's own
step count, the world size of every step, the sampler's progress, the validation loss, a digest of the
weights), the generation lines (weights and leftover gradients when a generation starts) and the
checkpoint directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from example_module import load_example

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt.py"
STEPS, KILL_AT, WORKERS = 30, 10, 3

SLOT = re.compile(
    r"^slot (?P<slot>\d+) \(life (?P<life>\d+)\): step (?P<step>\d+), optimizer steps (?P<adam>[\d/]+), "
    r"world sizes (?P<worlds>[\dx ]+), sampler \{'seed': 0, 'epoch': (?P<epoch>\d+), "
    r"'consumed': (?P<consumed>\d+)\}, val loss (?P<val>\S+), weights (?P<w>[0-9a-f]{8})$",
    re.M,
)
GENERATION = re.compile(
    r"^\[rank (?P<slot>\d+)\] generation (?P<gen>\d+) starts at step (?P<step>\d+) as rank \d+ of "
    r"(?P<size>\d+) \(slot (?P=slot), life (?P<life>\d+)\), weights (?P<w>[0-9a-f]{8}), (?P<grads>.*)$",
    re.M,
)
INITIAL = re.compile(r"^\[rank (\d+)\] slot \1: initial weights ([0-9a-f]{8})$", re.M)
VAL = re.compile(r"^\[rank \d+\] step (\d+): val loss (\S+) ", re.M)


def example() -> ModuleType:
    """The example as a module, for its sizes (importing it defines things and builds the tiny dataset)."""
    return load_example(EXAMPLE, "gpt_example")


def sampler_after(world_sizes: list[int], samples: int, per_rank: int) -> tuple[int, int]:
    """(epoch, consumed) of an ElasticSampler with drop_last after one advance() per step: a step of a
    world of w takes w * per_rank samples; an epoch with fewer left than that is over."""
    epoch = consumed = 0
    for w in world_sizes:
        if samples - consumed < w * per_rank:
            epoch, consumed = epoch + 1, 0
        consumed += w * per_rank
    return epoch, consumed


def expand(runs: str) -> list[int]:
    """ "3x2 2x1" -> [3, 3, 2]."""
    return [int(n) for run in runs.split() for n in [run.split("x")[0]] * int(run.split("x")[1])]


@pytest.mark.timeout(240)
def test_gpt_example_survives_a_kill_mid_accumulation_and_every_slot_agrees(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1")
    args = ["--steps", str(STEPS), "--kill-at", str(KILL_AT), "--workers", str(WORKERS), "--ckpt", "ckpt"]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out

    # The kill happened where asked, and spawn restarted that slot.
    assert f"[rank 2] step {KILL_AT}: killing this worker (SIGKILL) mid-accumulation" in out, out
    assert "restarting slot 2 (restart 1 of 1)" in out, out

    # Every slot ends at the same state; the killed slot is there, in its second life.
    slots = {int(m["slot"]): m for m in SLOT.finditer(out)}
    assert sorted(slots) == [0, 1, 2], out
    assert {s: int(m["life"]) for s, m in slots.items()} == {0: 0, 1: 0, 2: 1}, out
    fields = ("step", "adam", "worlds", "epoch", "consumed", "val", "w")
    assert len({tuple(m[f] for f in fields) for m in slots.values()}) == 1, out
    final = slots[0]
    assert f"step {STEPS}, val loss {final['val']}, weights {final['w']} on every slot" in out, out

    # Exactly STEPS optimizer steps: the step count, AdamW's own counter on every parameter and the
    # per-step record agree, so the step in flight at the kill was redone once and nothing else.
    worlds = expand(final["worlds"])
    assert int(final["step"]) == STEPS and final["adam"] == str(STEPS), out
    assert len(worlds) == STEPS, out
    # All three from the start (first_workers), the kill after KILL_AT steps, the survivors went on.
    assert worlds[:KILL_AT] == [WORKERS] * KILL_AT and worlds[KILL_AT] == WORKERS - 1, out

    # The sampler's progress is exactly one advance() per step of the world that took it.
    gpt = example()
    per_rank = gpt.MICRO_BATCH * gpt.ACCUMULATION
    assert (int(final["epoch"]), int(final["consumed"])) == sampler_after(worlds, len(gpt.TRAIN), per_rank)

    # Generations: the first one holds slot 0's weights everywhere (equal tenures: ties go by slot).
    initial = dict(INITIAL.findall(out))
    assert sorted(initial) == ["0", "1", "2"] and len(set(initial.values())) == 3, out  # own weights each
    gens = list(GENERATION.finditer(out))
    first = [g for g in gens if g["gen"] == "0"]
    assert len(first) == WORKERS and {g["w"] for g in first} == {initial["0"]}, out
    # The survivors redo step KILL_AT with no gradients left from the interrupted accumulation.
    survivors = [g for g in gens if g["step"] == str(KILL_AT) and g["size"] == str(WORKERS - 1)]
    assert sorted(g["slot"] for g in survivors) == ["0", "1"], out
    assert {g["grads"] for g in survivors} == {"no gradients left"}, out
    # The replacement received the group's state (its own fresh weights were replaced).
    [back] = [g for g in gens if g["slot"] == "2" and g["life"] == "1"]
    peers = {g["w"] for g in gens if g["gen"] == back["gen"]}
    assert int(back["step"]) >= KILL_AT and peers == {back["w"]} and back["w"] != initial["2"], out
    assert back["grads"] == "no gradients left", out

    # It learns; the evaluation at KILL_AT ran twice (before the kill and again in the survivors'
    # generation) and so did its save: the second got the `.1` suffix and counts as a checkpoint of its
    # own for retention (keep=3), which removed the older of the two.
    vals = [(int(s), float(v)) for s, v in VAL.findall(out)]
    assert [s for s, _ in vals] == [0, KILL_AT, KILL_AT, 20, STEPS], out
    assert abs(vals[-1][1] - float(final["val"])) < 1e-4 and vals[-1][1] < vals[0][1] - 0.2, out
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["ckpt-000000000010.1", "ckpt-000000000020", "ckpt-000000000030"], names
