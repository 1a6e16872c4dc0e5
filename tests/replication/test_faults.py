"""The fault matrix: a rank dies or raises at each phase of `sync` and `save`.

In every case the surviving ranks raise an `ElasticError` within the timeout, naming the phase; receivers
that may hold half-written tensors are torn (tenure None, so they never win the next election); the
source is unchanged; no checkpoint on disk is left invalid. Faults are injected with the
``ELASTIC_FAULT="<rank>:<phase>[:die]"`` hook (`elastic.replication.comm.fault_point`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import elastic
from dist_harness import TRANSPORTS, run_on_ranks, use_transport


@elastic.elastic_state(tenure="step")
@attrs.define
class S:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    step: int = 0
    notes: list = attrs.field(factory=list)


def make(rank: int) -> S:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
    s = S(model, torch.optim.Adam(model.parameters()))
    if rank == 1:  # rank 1 is the most tenured: the source and the writer
        for _ in range(3):
            s.opt.zero_grad()
            s.model(torch.randn(4, 32)).sum().backward()
            s.opt.step()
        s.step = 3
        s.notes.append("trained")
    return s


def snapshot(s: S) -> dict[str, Any]:
    out: dict[str, Any] = {k: v.clone() for k, v in s.model.state_dict().items()}
    for idx, st in s.opt.state_dict()["state"].items():
        out.update({f"opt.{idx}.{k}": v.clone() for k, v in st.items()})
    out["step"], out["notes"] = s.step, list(s.notes)
    return out


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _small_buckets(transport: str) -> None:
    # a dozen buckets for this state, no direct broadcast
    use_transport(transport, bucket_bytes=1024, direct_bytes=1 << 40)


def _outcome(fn: Any) -> tuple[str, str, str | None] | None:
    try:
        fn()
    except elastic.ElasticError as exc:
        return type(exc).__name__, str(exc), getattr(exc, "phase", None)
    return None


# ---------------------------------------------------------------------------------------------------------
# A rank that dies: one spawn per phase (the group is broken afterwards).


def _die(rank: int, world: int, phase: str, root: str, transport: str) -> dict[str, Any]:
    _small_buckets(transport)
    s = make(rank)
    out: dict[str, Any] = {}
    if phase in ("write", "rename"):
        elastic.save(s, root, timeout=20)  # a complete checkpoint at tenure 3 ...
        s.step += 1
        os.environ["ELASTIC_FAULT"] = f"1:{phase}:die"  # ... then the writer dies saving tenure 4
        before = snapshot(s)
        out["error"] = _outcome(lambda: elastic.save(s, root, timeout=10))
    else:
        os.environ["ELASTIC_FAULT"] = f"1:{phase}:die"
        before = snapshot(s)
        out["error"] = _outcome(lambda: elastic.sync(s, timeout=10))
    out["tenure"] = elastic.tenure(s)
    out["unchanged"] = equal(before, snapshot(s))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_that_dies_in_any_phase(tmp_path: Path, transport: str) -> None:
    cases = {"elect": "elect", "objects": "objects", "bucket 2": "bucket", "write": "save", "rename": "save"}
    if transport != TRANSPORTS[0]:  # a checkpoint's phases move no tensor between ranks: once is enough
        cases = {k: v for k, v in cases.items() if v != "save"}
    for phase, named in cases.items():
        root = tmp_path / phase.replace(" ", "_")
        results = run_on_ranks(_die, 2, args=(phase, str(root), transport), allow_exit=True, timeout=60)
        assert results[1] is None, f"{phase}: rank 1 was to die"
        survivor = results[0]
        assert survivor["error"] is not None, f"{phase}: the survivor must raise"
        kind, msg, where = survivor["error"]
        assert kind == "SyncError", (phase, msg)
        assert where is not None
        assert where.startswith(named) or (named == "bucket" and where == "commit"), (phase, where)
        assert f"phase '{where}'" in msg and "rank 0" in msg
        if phase.startswith("bucket"):
            assert survivor["tenure"] is None, "a receiver that may be half-written is torn"
        else:
            # nothing reached the receiver: its state and tenure are intact
            assert survivor["unchanged"]
            assert survivor["tenure"] == (1 if named == "save" else 0)
        if phase in ("write", "rename"):
            # the earlier checkpoint stays valid and is what a reader gets; the dead writer's
            # temporary directory is ignored (and removed by the next save)
            fresh = make(0)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no corrupt checkpoint to skip
                report = elastic.load(fresh, root)
            assert report.source == "checkpoint" and report.tenure == 3
            assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == [report.path.name]
            assert fresh.notes == ["trained"]
            elastic.save(fresh, root)  # cleans the dead writer's temporary directory
            assert [p.name for p in root.iterdir() if p.name.startswith(".tmp")] == []


# ---------------------------------------------------------------------------------------------------------
# A rank that raises: the group survives, so one spawn runs them all.


def _raise(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for transport in TRANSPORTS:  # the group survives a raise: both transports in one spawn
        _small_buckets(transport)
        out[transport] = {}
        for spec in SYNC_FAULTS:
            s = make(rank)
            before = snapshot(s)
            os.environ["ELASTIC_FAULT"] = spec
            got: dict[str, Any] = {"error": _outcome(lambda s=s: elastic.sync(s, timeout=20))}
            del os.environ["ELASTIC_FAULT"]
            got["tenure"] = elastic.tenure(s)
            got["unchanged"] = equal(before, snapshot(s))
            # the next sync heals every torn rank, the most tenured untorn rank wins
            got["next"] = elastic.sync(s, timeout=20).src
            out[transport][spec] = got
    s = make(rank)
    first = elastic.save(s, root, timeout=20)
    for spec in SAVE_FAULTS:
        s.step += 1
        os.environ["ELASTIC_FAULT"] = spec
        out[spec] = {"error": _outcome(lambda s=s: elastic.save(s, root, timeout=20))}
        del os.environ["ELASTIC_FAULT"]
        out[spec]["listing"] = sorted(p.name for p in Path(root).iterdir() if not p.name.startswith("."))
    out["first"] = first.name
    return out


SYNC_FAULTS = ("1:flatten", "1:bucket 2", "0:bucket 2", "0:apply")
SAVE_FAULTS = ("1:write", "1:manifest", "1:rename")


@pytest.mark.timeout(120)
def test_a_rank_that_raises_in_any_phase(tmp_path: Path) -> None:
    results = run_on_ranks(_raise, 2, args=(str(tmp_path),), timeout=90)
    for transport in TRANSPORTS:
        for spec in SYNC_FAULTS:
            r0, r1 = results[0][transport][spec], results[1][transport][spec]
            where = f"{transport}, {spec}"
            assert r0["error"] == r1["error"], f"{where}: every rank raises the same error"
            kind, msg, _ = r0["error"]
            assert kind == "SyncError", where
            failing = spec.split(":")[0]
            assert f"rank {failing}" in msg and "fault injected" in msg, where
            assert r1["tenure"] == 3 and r1["unchanged"], f"{where}: the source is never modified"
            if spec == "1:flatten":
                assert r0["tenure"] == 0 and r0["unchanged"], (
                    f"{where}: nothing moved, the receiver is intact"
                )
            else:
                assert r0["tenure"] is None, f"{where}: the receiver is torn"
            assert r0["next"] == r1["next"] == 1, f"{where}: a torn receiver never wins the next election"
    first = results[0]["first"]
    for spec in SAVE_FAULTS:
        r0, r1 = results[0][spec], results[1][spec]
        assert r0["error"] == r1["error"]
        kind, msg, _ = r0["error"]
        assert kind == "CheckpointError" and "on rank 1 (the writer)" in msg and "fault injected" in msg
        assert r0["listing"] == [first], f"{spec}: no partial checkpoint is published"
    fresh = make(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert elastic.load(fresh, tmp_path).tenure == 3
