"""`Comm`: failures of torch's collectives become `SyncError`s that keep torch's error as the cause."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

import elastic
from elastic._util.placement import Placement
from elastic.replication.comm import Comm


def _comm(timeout: timedelta | None) -> Comm:
    comm = Comm.__new__(Comm)  # no process group needed to turn errors into messages
    comm.group, comm.op, comm.timeout, comm.rank, comm.world_size = None, "sync", timeout, 1, 2
    comm.placement = Placement(torch.device("cpu"))
    comm.device = comm.placement.device
    return comm


class _Work:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def wait(self, *args: Any) -> None:
        raise self.exc


def test_a_failed_wait_keeps_torch_error_as_the_cause() -> None:
    torch_error = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer\n  more detail")
    with pytest.raises(elastic.SyncError) as info:
        _comm(None).wait(_Work(torch_error), "bucket 3")
    err = info.value
    assert err.__cause__ is torch_error and err.phase == "bucket 3"
    assert str(err) == (
        "sync failed in phase 'bucket 3' on rank 1: [../gloo/transport/tcp/pair.cc:534] Connection closed by "
        "peer. A peer probably died; re-form the process group (or let torchrun restart the workers) and "
        "sync again"
    )


def test_a_timeout_names_the_deadline_and_keeps_the_cause() -> None:
    torch_error = RuntimeError("Timed out waiting 2000ms for recv operation to complete")
    with pytest.raises(elastic.SyncError) as info:
        _comm(timedelta(seconds=2)).wait(_Work(torch_error), "elect")
    assert info.value.__cause__ is torch_error
    assert str(info.value).startswith("sync timed out in phase 'elect' on rank 1 after 2s: a peer did not")
    assert str(info.value).endswith("(Timed out waiting 2000ms for recv operation to complete)")


def test_a_collective_that_cannot_be_issued_keeps_the_cause() -> None:
    torch_error = ValueError("Tensors must be contiguous")

    def collective(*args: Any, **kwargs: Any) -> None:
        raise torch_error

    for call in (_comm(None).run, _comm(None).issue):
        with pytest.raises(elastic.SyncError, match="in phase 'objects' on rank 1: Tensors must be") as info:
            call("objects", collective)
        assert info.value.__cause__ is torch_error


def test_a_launcher_world_without_a_process_group_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import attrs

    @elastic.elastic_state(tenure="step")
    @attrs.define
    class Alone:
        step: int = 0

    s = Alone()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert elastic.sync(s).world_size == 1  # one rank: local, as before
    monkeypatch.setenv("WORLD_SIZE", "2")
    calls = {
        "sync": lambda: elastic.sync(s),
        "verify": lambda: elastic.verify(s),
        "save": lambda: elastic.save(s, tmp_path),
        "load": lambda: elastic.load(s, tmp_path),
    }
    for op, call in calls.items():
        with pytest.raises(elastic.ElasticError, match=r"call elastic\.init_process_group\(\)") as info:
            call()
        assert str(info.value).startswith(f"{op}: WORLD_SIZE=2 says this process is one of 2 ranks")
    assert list(tmp_path.iterdir()) == []  # nothing was written
