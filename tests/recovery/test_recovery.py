"""Recovering in-process: after a rank dies mid-sync, the survivors form a new group with a brand-new
worker and sync again, without restarting anything."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import attrs
import pytest
import torch
import torch.distributed as dist

import elastic
from dist_harness import TRANSPORTS, run_on_ranks, use_transport


@elastic.elastic_state(tenure="step")
@attrs.define
class S:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    step: Any = 0


def _make(seed: int) -> S:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))
    return S(model, torch.optim.Adam(model.parameters()))


def _train(s: S, steps: int) -> None:
    for _ in range(steps):
        s.opt.zero_grad()
        s.model(torch.randn(4, 16)).pow(2).mean().backward()
        s.opt.step()
        s.step += 1


def _body(proc: int, nprocs: int, transport: str) -> dict[str, Any]:
    """Processes 0, 1, 2 form generation 0; 2 dies mid-sync; 0, 1 and the new process 3 form generation 1."""
    # several buckets, so that a death lands mid-transfer
    use_transport(transport, bucket_bytes=1024)
    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore("127.0.0.1", port, nprocs, is_master=proc == 0, timeout=timedelta(seconds=60))
    out: dict[str, Any] = {}
    s = _make(proc)
    if proc < 3:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("gen0", store),
            rank=proc,
            world_size=3,
            timeout=timedelta(seconds=30),
        )
        _train(s, 5 if proc == 0 else 2)  # process 0 is the most tenured
        if proc == 2:
            os.environ["ELASTIC_FAULT"] = "2:bucket 1:die"  # a receiver dies mid-transfer
        try:
            elastic.sync(s, timeout=10)
        except elastic.SyncError as exc:
            out["error"] = exc.phase
        out["tenure_after_failure"] = elastic.tenure(s)
        dist.destroy_process_group()  # the broken group
        store.add("gen0-left", 1)
        new_rank = proc
    else:
        while store.add("gen0-left", 0) < 2:  # the replacement joins when the survivors have left gen0
            time.sleep(0.05)
        new_rank = 2
    gen1 = dist.PrefixStore("gen1", store)
    dist.init_process_group("gloo", store=gen1, rank=new_rank, world_size=3, timeout=timedelta(seconds=30))
    report = elastic.sync(s, timeout=20)
    elastic.verify(s)
    out["report"] = (report.src, report.tenure, report.tensor_bytes > 0)
    out["params"] = [p.detach().clone() for p in s.model.parameters()]
    out["exp_avg"] = s.opt.state_dict()["state"][0]["exp_avg"].clone()
    dist.destroy_process_group()
    store.add("done", 1)
    if proc == 0:  # the store's host waits for everyone before it goes away
        while store.add("done", 0) < 3:
            time.sleep(0.05)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_survivors_and_a_new_worker_resync_in_process(transport: str) -> None:
    results = run_on_ranks(_body, 4, args=(transport,), init_group=False, allow_exit=True, timeout=100)
    survivor0, survivor1, dead, fresh = results
    assert dead is None  # process 2 died
    assert survivor0["error"] is not None and survivor1["error"] is not None
    assert survivor0["tenure_after_failure"] == 5  # the source is never torn
    assert survivor1["tenure_after_failure"] is None  # a receiver that may be half-written is torn
    for r in (survivor0, survivor1, fresh):
        assert r["report"] == (0, 5, True)  # the most tenured survivor wins; torn and fresh receive
    for r in (survivor1, fresh):
        assert all(torch.equal(a, b) for a, b in zip(r["params"], survivor0["params"]))
        assert torch.equal(r["exp_avg"], survivor0["exp_avg"])
