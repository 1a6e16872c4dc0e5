"""`benchmarks/gpu_check.py` run as CI can run it: on the CPU, small.

Every part's CPU analogue must run and be right, the CUDA-only parts must say SKIPPED and why, and a wrong
value (injected with the hidden ``--inject-wrong`` flag) must make the script fail, so that the check
itself is checked. Two runs of the script (both with the sync part's two gloo ranks and the sharded part's
world of one and two gloo ranks) plus in-process checks of its argument handling.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SMALL = ["--model-gib", "0.004", "--ckpt-gib", "0.008", "--tensors", "32", "--rounds", "1", "--timeout", "60"]
#: Where CUDA exists the CPU analogue is asked for, so that the test checks the same table everywhere.
CPU_FLAGS = ["--cpu"] if torch.cuda.is_available() else []
REASON = "--cpu given" if torch.cuda.is_available() else "torch.cuda.is_available() is False"


def _run(*flags: str, tmp_path: Path) -> tuple[int, str, dict[tuple[str, str], tuple[str, str]]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL, *CPU_FLAGS, "--dir", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr, _table(proc.stdout)


def _table(out: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(part, step) -> (status, value) from the printed table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("part ")) + 2
    rows = {}
    for line in lines[start:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[(cells[0], cells[1])] = (cells[2], cells[3] if len(cells) > 3 else "")
    return rows


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_analogue_runs_every_part_and_names_the_skipped_cuda_parts(tmp_path: Path) -> None:
    rc, out, rows = _run(tmp_path=tmp_path)
    assert rc == 0, out
    statuses = {status for status, _ in rows.values()}
    assert statuses <= {"ok", "info", "SKIPPED"}, out
    checks = {
        ("sync", "sync: report (src 0, all bytes moved)"),
        ("sync", "sync: in place"),
        ("sync", "sync: values equal rank 0's"),
        ("sync", "sync: source untouched (storage)"),
        ("sync", "sync: source values unchanged"),
        ("sync", "verify: replicas agree"),
        ("sync", "verify: catches a one-element change"),
        ("sync", "sync: fast path (tensor_bytes == 0)"),
        ("ckpt", "save (blocking)"),
        ("ckpt", "save(blocking=False) #1: blocks the caller"),
        ("ckpt", "save(blocking=False) #2: blocks the caller"),
        ("ckpt", "save(blocking=False): staging reused"),
        ("ckpt", "load: from the newest checkpoint"),
        ("ckpt", "load: in place"),
        ("ckpt", "load: values equal the async save's"),
        ("world1/gloo", 'init_process_group("gloo")'),
        ("world1/gloo", "sync"),
        ("world1/gloo", "verify"),
        ("world1/gloo", "object payloads on cpu"),
        ("world1/gloo", "BroadcastTransport.send (source's half)"),
        ("world1/gloo", "save"),
        ("world1/gloo", "load"),
        ("world1/gloo", "save(blocking=False)"),
        ("sharded", "world of one (gloo): FSDP2 state"),
        ("sharded", "world of one (gloo): sync moves nothing"),
        ("sharded", "world of one (gloo): save (DCP format)"),
        ("sharded", "world of one (gloo): sync and save leave the state"),
        ("sharded", "2 CPU gloo ranks, mesh (2,): load"),
        ("sharded", "2 CPU gloo ranks: resharded into two pieces"),
        ("sharded", "2 CPU gloo ranks: model as saved"),
        ("sharded", "2 CPU gloo ranks: optimizer state as saved"),
        ("sharded", "2 CPU gloo ranks: optimizer param_groups as saved"),
    }
    assert {key: rows.get(key, ("missing", ""))[0] for key in checks} == dict.fromkeys(checks, "ok"), out
    assert rows[("sync", "sync: in place")][1] == "128/128 data_ptr kept; parameter objects kept"
    # One value when both ranks print the same text (same milliseconds), else "r0: ...; r1: ...".
    fast = rows[("sync", "sync: fast path (tensor_bytes == 0)")][1]
    assert re.fullmatch(r"(r0: )?tensor_bytes 0, [\d.]+ ms(; r1: tensor_bytes 0, [\d.]+ ms)?", fast), fast
    assert rows[("ckpt", "save(blocking=False): staging reused")][1] == "128/128 buffers the same"
    assert rows[("ckpt", "load: values equal the async save's")][1] == "128/128 tensors bitwise equal"
    assert re.match(
        r"[1-9][0-9]* direct, [0-9]+ bucketed; source unchanged",
        rows[("world1/gloo", "BroadcastTransport.send (source's half)")][1],
    )
    sharded = {step: value for (part, step), (_, value) in rows.items() if part == "sharded"}
    assert (
        sharded["world of one (gloo): sync moves nothing"] == "world_size 1, tensor_bytes 0, object_bytes 0"
    )
    assert re.fullmatch(
        r"ckpt-0+1: (?=.*\.metadata)(?=.*__0_0\.distcp)(?=.*manifest\.json).*",
        sharded["world of one (gloo): save (DCP format)"],
    ), sharded
    assert (
        sharded["2 CPU gloo ranks, mesh (2,): load"]
        == "checkpoint, tenure 1, written by a world of 1, step 1"
    )
    assert sharded["2 CPU gloo ranks: resharded into two pieces"] == "0.weight (33 rows): 17 + 16 rows"
    # Nine model tensors (two Linears, a BatchNorm's parameters and buffers), Adam's three per parameter.
    assert sharded["2 CPU gloo ranks: model as saved"] == "9/9 tensors bit for bit"
    assert sharded["2 CPU gloo ranks: optimizer state as saved"] == "18/18 tensors bit for bit"
    assert re.fullmatch(
        r"(\d+)/\1 other values equal", sharded["2 CPU gloo ranks: optimizer param_groups as saved"]
    )
    assert re.fullmatch(
        r"(\d+)/\1 tensors bit for bit, (\d+)/\2 other values equal",
        sharded["world of one (gloo): sync and save leave the state"],
    )
    timing = rows[("sync", "time: sync(force=True) vs one flat broadcast")]
    assert timing[0] == "info" and re.search(r"\(gloo, CPU\): [0-9.]+x", timing[1]), timing
    skipped = {key: value for key, (status, value) in rows.items() if status == "SKIPPED"}
    assert set(skipped) == {
        ("cuda", "states on cuda:0"),
        ("cuda", "peak GPU memory"),
        ("sync", "two ranks under NCCL"),
        ("ckpt", "pinned staging"),
        ("ckpt", "load: no GPU copy of the state"),
        ("world1", "NCCL world of one"),
        ("sharded", "NCCL world of one"),
    }
    assert skipped[("sync", "two ranks under NCCL")] == "one GPU: NCCL refuses two ranks on one device"
    assert all(value.startswith(REASON) for key, value in skipped.items() if key[1] != "two ranks under NCCL")
    assert skipped[("world1", "NCCL world of one")] == f"{REASON}: ran under gloo instead"
    assert skipped[("sharded", "NCCL world of one")] == f"{REASON}: ran under gloo instead"
    assert f"every value right ({len(checks)} checks)" in out
    assert list(tmp_path.iterdir()) == []  # its checkpoints are removed


def test_a_wrong_value_fails_the_check(tmp_path: Path) -> None:
    rc, out, rows = _run(
        "--parts", "sync,ckpt,sharded", "--inject-wrong", "sync,load,sharded", tmp_path=tmp_path
    )
    assert rc == 1, out
    assert rows[("sync", "sync: values equal rank 0's")] == ("WRONG", "127/128 tensors bitwise equal")
    assert rows[("sync", "verify: replicas agree")][0] == "WRONG"  # verify sees the corrupted replica
    assert rows[("ckpt", "load: values equal the async save's")] == ("WRONG", "127/128 tensors bitwise equal")
    assert rows[("sync", "sync: in place")][0] == "ok"  # only the values were corrupted
    assert rows[("ckpt", "load: in place")][0] == "ok"
    assert rows[("sharded", "2 CPU gloo ranks: model as saved")] == (
        "WRONG",
        "8/9 tensors bit for bit; first differing: 0.weight",
    )
    assert rows[("sharded", "2 CPU gloo ranks: optimizer state as saved")][0] == "ok"
    assert not any(part == "world1" for part, _ in rows)  # --parts
    last = [line for line in out.splitlines() if line.startswith("gpu_check: ")][-1]  # stderr may follow
    assert "WRONG or ERROR row(s)" in last
    assert "values equal rank 0's" in last and "load: values equal the async save's" in last
    assert "2 CPU gloo ranks: model as saved" in last


def test_parts_and_sizes() -> None:
    script = _load_script()
    with pytest.raises(SystemExit) as info:
        script.parse(["--parts", "sync,bogus"])
    assert info.value.code == 2
    assert script.parse(["--parts", "ckpt"]).parts == "ckpt"
    assert script.PARTS == ("sync", "ckpt", "world1", "sharded")
    sizes = script.param_sizes(8 * 2**20, 10)
    assert len(sizes) == 10 and sizes[1::2] == [script.SMALL_BYTES // 4] * 5
    assert abs(sum(sizes) * 4 - 8 * 2**20) < 4 * 5  # the weights take the rest, to the element
