"""Every notebook in `notebooks/` runs top to bottom in a fresh kernel and shows what it claims.

The kernel is this interpreter (`sys.executable -m ipykernel_launcher`), declared in a kernelspec written
to a temporary directory, so the test needs no kernel installed beforehand and always runs the code of
this checkout.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
KERNEL = "elastic-test-python"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A kernelspec running this very interpreter, found through JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    before = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(root), *([before] if before else [])])
    yield KERNEL
    if before is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = before


def execute(path: Path, kernel: str) -> Any:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=kernel, timeout=300, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    return nb


def cell_text(cell: Any) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def test_there_are_notebooks() -> None:
    assert "quickstart.ipynb" in [p.name for p in NOTEBOOKS]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_shows_the_workers(path: Path, kernel_name: str) -> None:
    nb = execute(path, kernel_name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert errors == []
    texts = [cell_text(c) for c in code]
    assert any("[rank 1] " in t for t in texts), "no worker output reached a cell"
    if path.stem == "quickstart":
        check_quickstart(texts)
    if path.stem == "recovery":
        check_recovery(texts)
    if path.stem == "fsdp":
        check_fsdp(texts)


def check_fsdp(texts: list[str]) -> None:
    run_cell = next(t for t in texts if "killing this worker" in t)
    assert "[rank 3] killing this worker (SIGKILL) after step 6" in run_cell
    assert "restarting slot 3 (restart 1 of 1)" in run_cell
    gens = re.findall(
        r"^generation (\d+): (\d) workers, mesh (\([\d, ]+\)) .*?, from step (\d+) at [\d.]+ s(.*)$",
        run_cell,
        re.M,
    )
    assert [(size, mesh) for _, size, mesh, _, _ in gens] == [("4", "(2, 2)"), ("3", "(3,)"), ("4", "(2, 2)")]
    (_, _, _, first, _), (_, _, _, resumed, after_kill), (number, _, _, rejoined, after_join) = gens
    assert first == "0" and resumed in ("5", "6") and int(rejoined) > int(resumed)  # <= 1 step lost
    assert after_kill == f": the state equal bit for bit to step {resumed} before"
    assert after_join.endswith("; the replacement received it bit for bit")
    assert (
        f"[rank 3] slot 3 life 1: generation {number}, rank 3 of 4, mesh (2, 2), from step {rejoined}"
        in run_cell
    )
    finals = re.search(r"^finished at step (\d+), state digest by slot: ([0-9a-f ]+): (.+)$", run_cell, re.M)
    assert finals and int(finals.group(1)) >= 16 and len(set(finals.group(2).split())) == 1
    assert finals.group(3) == "the same on every worker"
    plot_cell = next(t for t in texts if "meshes: " in t)
    assert "Figure" in plot_cell  # the plot, then what it shows
    assert "meshes: (2, 2) -> (3,) -> (2, 2); kill -> first step: " in plot_cell
    assert f"steps lost: {6 - int(resumed)};" in plot_cell
    assert "every generation started from the state of its step, bit for bit: True" in plot_cell
    assert "final state digests equal on all 4 workers: True" in plot_cell


def check_recovery(texts: list[str]) -> None:
    run_cell = next(t for t in texts if "killing this worker" in t)
    killed = re.search(r"\[rank 2\] killing this worker \(SIGKILL\) at step (\d+)", run_cell)
    assert killed and int(killed.group(1)) >= 40
    assert "restarting slot 2 (restart 1 of 1)" in run_cell
    step = killed.group(1)
    survivor = rf"\[rank 0\] slot 0 life 0: generation \d+, rank \d of [12], starting at step {step}"
    assert re.search(survivor, run_cell)  # went on from the step it was at
    replacement = r"\[rank 2\] slot 2 life 1: generation \d+, rank \d of 3, starting at step \d+"
    assert re.search(replacement, run_cell)
    assert "final weights equal on every worker: True" in run_cell
    assert any("survivors redid 0 steps" in t for t in texts)


def check_quickstart(texts: list[str]) -> None:
    sync_cell = next(t for t in texts if "before: step=" in t)
    after = re.findall(r"\[rank (\d)\] after:  step=(\d+) bias=(\[[^\]]*\]) \(from rank (\d)\)", sync_cell)
    assert sorted(r for r, *_ in after) == ["0", "1", "2"]
    assert {(step, bias, src) for _, step, bias, src in after} == {
        (after[0][1], after[0][2], "1")
    }  # every rank: the same step and bias, from rank 1
    assert after[0][1] == "7"
    assert "[rank 1] before: step=7" in sync_cell
    assert any("all 3 workers hold rank 1's state: (7," in t and "in place: True" in t for t in texts)

    restart_cell = next(t for t in texts if "attempt 0: starting" in t)
    assert "[rank 0] attempt 0: starting at step 0 (from memory)" in restart_cell
    assert "[rank 0] attempt 1: starting at step 5 (from checkpoint)" in restart_cell
    assert "final state on every worker: (12," in restart_cell

    assert any("DivergenceError" in t or "differ" in t for t in texts if "bias" in t and "[rank" not in t)
    assert any("rank 2 raised ValueError: learning rate must be positive" in t for t in texts)
