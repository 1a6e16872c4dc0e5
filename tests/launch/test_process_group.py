"""`elastic.init_process_group`: env:// outside torchrun, per-restart key namespaces on torchrun's store.

The in-process tests start a world-1 gloo group in the test process (and destroy it). The multi-process
tests restart a spawned group four times in a row (each rank dies twice), and run a real torchrun job
whose worker dies on the
first attempt.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import elastic
from elastic.launch import process_group as _process_group

TORCHRUN_ENV = (
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
)


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    """A TCPStore server in this process, standing in for torchrun's agent store."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    yield store


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_process_group, "_warned_shared_store", False)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


def _torchrun_env(mp: pytest.MonkeyPatch, port: int, restart: int, agents: int = 1) -> None:
    mp.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    mp.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    mp.setenv("GROUP_WORLD_SIZE", str(agents))
    mp.setenv("MASTER_ADDR", "127.0.0.1")
    mp.setenv("MASTER_PORT", str(port))
    mp.setenv("RANK", "0")
    mp.setenv("WORLD_SIZE", "1")
    mp.setenv("LOCAL_RANK", "0")


def test_each_restart_gets_its_own_namespace_on_the_agent_store(
    server: dist.TCPStore, clean_env: pytest.MonkeyPatch
) -> None:
    _torchrun_env(clean_env, server.port, restart=3)
    third = _process_group.agent_store(timedelta(seconds=10))
    third.set("peer/1", "address of attempt 3")
    assert server.get("elastic/restart3/peer/1") == b"address of attempt 3"
    assert _process_group.store_prefix(3) == "elastic/restart3"

    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    fourth = _process_group.agent_store(timedelta(seconds=10))
    assert not fourth.check(["peer/1"])  # attempt 4 never sees attempt 3's keys
    fourth.set("peer/1", "address of attempt 4")
    assert third.get("peer/1") == b"address of attempt 3"


def test_under_torchrun_with_several_agents_it_warns_once(
    server: dist.TCPStore, clean_env: pytest.MonkeyPatch
) -> None:
    _torchrun_env(clean_env, server.port, restart=0, agents=2)
    with pytest.warns(RuntimeWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") as caught:
        elastic.init_process_group("gloo", timeout=10)
    assert len(caught) == 1
    assert "2 torchrun agents" in str(caught[0].message)
    assert dist.is_initialized()
    assert dist.get_backend() == "gloo"
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    dist.barrier()

    with pytest.raises(elastic.ElasticError, match="already initialised"):
        elastic.init_process_group("gloo")
    dist.destroy_process_group()

    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        elastic.init_process_group("gloo", timeout=timedelta(seconds=10))
    assert dist.get_world_size() == 1


def test_outside_torchrun_it_is_env_init_and_missing_variables_are_named(
    server: dist.TCPStore, clean_env: pytest.MonkeyPatch
) -> None:
    with pytest.raises(elastic.ElasticError, match="RANK is not set"):
        elastic.init_process_group()
    with pytest.raises(TypeError, match="timeout"):
        elastic.init_process_group(timeout=-1)
    with pytest.raises(TypeError, match="backend"):
        elastic.init_process_group(7)  # type: ignore[arg-type]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(port))
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    elastic.init_process_group()  # no backend on a CPU-only machine: gloo
    if not torch.cuda.is_available():
        assert dist.get_backend() == "gloo"
    assert dist.get_world_size() == 1
    dist.barrier()


def test_an_existing_group_is_the_same_error_here_and_in_run(clean_env: pytest.MonkeyPatch) -> None:
    from elastic.recovery import run as _run

    clean_env.setenv("RANK", "x")
    with pytest.raises(elastic.ElasticError, match=r"RANK='x' is not an integer") as bad:
        elastic.init_process_group("gloo")
    assert isinstance(bad.value.__cause__, ValueError)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(elastic.ElasticError, match="already initialised") as here:
        elastic.init_process_group("gloo")
    with pytest.raises(elastic.ElasticError, match="already exists") as in_run:
        _run._new_group(dist.HashStore(), None, "gloo", timedelta(seconds=10))
    assert type(here.value) is type(in_run.value) is elastic.ElasticError
    state = _run_state()
    with pytest.raises(elastic.ElasticError, match="already exists"):  # at once: the user's group stays
        elastic.run(lambda s, w: None, state, rdzv="127.0.0.1:1")
    assert dist.is_initialized()


def die_until_the_last_attempt(folder: str, last: int) -> int:
    """Every attempt initialises its group and records it; one rank then dies, until attempt `last`."""
    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = dist.get_rank()
    dist.barrier()
    with open(os.path.join(folder, f"attempt-{attempt}-rank-{rank}"), "w") as f:
        f.write(os.environ["TORCHELASTIC_USE_AGENT_STORE"])
    dist.barrier()  # both recorded this attempt
    if attempt < last:
        if rank == attempt % 2:
            os._exit(1)
        time.sleep(120)  # stopped by the agent
    dist.barrier()
    return attempt


@pytest.mark.timeout(300)
def test_a_spawned_group_restarted_four_times_in_a_row_finishes_every_attempt(tmp_path: Path) -> None:
    results = elastic.spawn(
        die_until_the_last_attempt, 2, args=(str(tmp_path), 4), max_restarts=4, timeout=280
    )
    assert results == [4, 4]
    recorded = sorted(p.name for p in tmp_path.iterdir())
    assert recorded == sorted(f"attempt-{a}-rank-{r}" for a in range(5) for r in range(2))
    assert {p.read_text() for p in tmp_path.iterdir()} == {"True"}  # on the agent's shared store


TORCHRUN_SCRIPT = """
    import os, time
    import torch, torch.distributed as dist
    import elastic

    elastic.init_process_group(timeout=60)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = dist.get_rank()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {rank} sum {total.item()} agent store "
          f"{os.environ['TORCHELASTIC_USE_AGENT_STORE']}", flush=True)
    if attempt == 0:
        dist.barrier()
        if rank == 1:
            os._exit(1)
        time.sleep(120)  # stopped by torchrun
    dist.barrier()
    dist.destroy_process_group()
    print(f"done attempt {attempt} rank {rank}", flush=True)
"""


@pytest.mark.torchrun
@pytest.mark.timeout(150)
def test_torchrun_restart_after_a_worker_dies(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=2",
            "--monitor-interval=0.1",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=140,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Both workers write to torchrun's stdout: lines of different ranks may run into each other.
    seen = set(re.findall(r"attempt (\d) rank (\d) sum 3\.0 agent store True", done.stdout))
    assert seen == {("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}
    assert sorted(re.findall(r"done attempt (\d) rank (\d)", done.stdout)) == [("1", "0"), ("1", "1")]


def _run_state() -> object:
    import attrs
    import torch

    @elastic.elastic_state(tenure="step")
    @attrs.define
    class Tiny:
        w: torch.Tensor
        step: int = 0

    return Tiny(torch.zeros(1))
