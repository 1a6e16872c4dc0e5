"""The main demo under real torchrun: `examples/train.py` survives killed workers, bit for bit.

Every test launches `python -m torch.distributed.run` (gloo, CPU) on the example and compares what the
workers save with `--out` against one uninterrupted reference run (module fixture): parameters, optimizer
and scheduler state, counters and the loss history must be identical to the bit. The example seeds each
worker's initial weights with its rank and attempt, so a restart that failed to restore the elected
checkpoint would train different weights and fail the comparison.

The runs are small (12 steps, a checkpoint every 4), since their time goes into starting torchrun, the
workers (each imports torch) and the restarts, not into training. Each torchrun invocation runs under a
subprocess timeout: a hang fails the test and its processes are killed, never left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

pytestmark = pytest.mark.torchrun

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
STEPS, SAVE_EVERY, BATCH = 12, 4, 32
TRAIN = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--timeout", "60", "--out", "out-{rank}.pt"]
RUN_TIMEOUT = 180  # seconds per torchrun invocation; generous, the machine is shared
LAUNCHER_ENV = ("TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_", "LOCAL_", "RANK", "WORLD_SIZE")

ELECTION = re.compile(
    r"\[rank (?P<rank>\d+)\] attempt (?P<attempt>\d+): elected rank (?P<src>\d+), resuming from "
    r"(?:memory|checkpoint (?P<path>\S+)) at tenure (?P<tenure>\S+) \(step (?P<step>\d+), "
    r"world size (?P<world>\d+)\); weights (?P<own>[0-9a-f]{8}) -> (?P<elected>[0-9a-f]{8})$"
)
CHECKPOINT = re.compile(r"\[rank (?P<rank>\d+)\] step (?P<step>\d+): checkpoint (?P<path>\S+)$")
DONE = re.compile(r"\[rank (?P<rank>\d+)\] done: step (?P<step>\d+), final loss \S+, weights (?P<w>\w+)$")


class Election(NamedTuple):
    rank: int
    attempt: int
    src: int
    path: str | None  # None: the state came from memory
    tenure: str
    step: int
    world: int
    own: str  # the worker's own random weights before the election
    elected: str  # the weights it holds after


class Run(NamedTuple):
    cwd: Path
    output: str

    def lines(self) -> list[str]:
        return self.output.splitlines()

    def elections(self, rank: int | None = None) -> list[Election]:
        """The election lines (of one rank), in the order they were logged."""
        found = []
        for line in self.lines():
            m = ELECTION.match(line)
            if m and (rank is None or int(m["rank"]) == rank):
                g = m.groupdict()
                found.append(
                    Election(
                        int(g["rank"]),
                        int(g["attempt"]),
                        int(g["src"]),
                        g["path"],
                        g["tenure"],
                        int(g["step"]),
                        int(g["world"]),
                        g["own"],
                        g["elected"],
                    )
                )
        return found

    def checkpoints(self) -> dict[int, list[tuple[int, str]]]:
        """rank -> [(step, path)] in the order that rank logged them."""
        found: dict[int, list[tuple[int, str]]] = {}
        for line in self.lines():
            m = CHECKPOINT.match(line)
            if m:
                found.setdefault(int(m["rank"]), []).append((int(m["step"]), m["path"]))
        return found

    def final_weights(self) -> dict[int, str]:
        return {int(m["rank"]): m["w"] for line in self.lines() if (m := DONE.match(line))}

    def out(self, rank: int) -> dict[str, Any]:
        return torch.load(self.cwd / f"out-{rank}.pt", weights_only=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_env(cwd: Path, *, share_store: bool) -> dict[str, str]:
    """This process's environment without any launcher variables, one thread per worker, temp in cwd."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_ENV)}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    (cwd / "tmp").mkdir(exist_ok=True)  # torchrun's log directories go here, not into /tmp
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(cwd / "tmp"))
    return env


def torchrun(
    cwds: Sequence[Path], launches: Sequence[Sequence[str]], *, share_store: bool = True
) -> list[Run]:
    """Start one torchrun agent per entry of `launches` (agent options + script options) at once, wait for
    all of them within RUN_TIMEOUT each, and return their outputs (also kept in `torchrun-<i>.log`); fail
    with every output on a non-zero exit."""
    procs, logs = [], []
    try:
        for i, (cwd, args) in enumerate(zip(cwds, launches, strict=True)):
            cwd.mkdir(parents=True, exist_ok=True)
            logs.append(cwd / f"torchrun-{i}.log")
            with logs[-1].open("w") as log:  # a file, not a pipe: an agent never blocks on its output
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "torch.distributed.run", *args],
                        cwd=cwd,
                        env=launcher_env(cwd, share_store=share_store),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group: the agent and its workers
                    )
                )
        for proc, args, log_path in zip(procs, launches, logs):
            try:
                proc.wait(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                output = log_path.read_text()[-5000:]
                pytest.fail(f"torchrun {' '.join(args)} did not finish within {RUN_TIMEOUT} s:\n{output}")
    finally:
        for proc in procs:  # after a timeout or an interrupt: nothing is left running
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    runs = [Run(cwd, log.read_text()) for cwd, log in zip(cwds, logs, strict=True)]
    if any(proc.returncode != 0 for proc in procs):
        codes = [proc.returncode for proc in procs]
        pytest.fail(f"torchrun exited with {codes}:\n" + "\n----\n".join(r.output for r in runs))
    return runs


def standalone(cwd: Path, workers: int, *script_args: str, restarts: int = 1) -> Run:
    agent = ["--standalone", f"--nproc-per-node={workers}", f"--max-restarts={restarts}"]
    return torchrun([cwd], [[*agent, str(EXAMPLE), *TRAIN, *script_args]])[0]


def assert_identical(got: Any, want: Any, where: str) -> None:
    """Equal to the bit: tensors by dtype, shape and bytes, containers recursively, other values by type
    and value."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} instead of a tensor"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: dtype or shape differs"
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (got, want)]
        assert torch.equal(*as_bytes), f"{where}: values differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__} instead of a dict"
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_identical(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
        assert repr(got) == repr(want), f"{where}: {got!r} != {want!r}"  # repr: exact for floats


def assert_matches_reference(run: Run, reference: Run, ranks: range = range(2)) -> None:
    want = reference.out(0)
    for rank in ranks:
        assert_identical(run.out(rank), want, f"rank {rank}'s final state")
    assert run.final_weights() == {rank: reference.final_weights()[0] for rank in ranks}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The uninterrupted run with 2 workers and a shared checkpoint directory."""
    return standalone(tmp_path_factory.mktemp("reference"), 2, "--ckpt", "ckpt", restarts=0)


@pytest.mark.timeout(300)
def test_workers_from_different_initialisations_train_the_elected_state(reference: Run) -> None:
    [first], [second] = reference.elections(0), reference.elections(1)
    assert first.own != second.own  # each worker drew its own random weights
    for e in (first, second):  # equal tenures (0): the lowest rank wins and both hold its weights
        assert (e.attempt, e.src, e.path, e.tenure, e.step, e.world) == (0, 0, None, "0", 0, 2)
        assert e.elected == first.own
    assert_identical(reference.out(1), reference.out(0), "rank 1's final state vs rank 0's")

    final = reference.out(0)
    assert (final["step"], final["epoch"], final["samples"], final["world_size"]) == (12, 1, 12 * BATCH, 2)
    assert len(final["history"]) == STEPS
    assert final["history"][-1] < 0.75 * final["history"][0]  # it learns
    steps = list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    saved = reference.checkpoints()
    assert [step for step, _ in saved[0]] == [step for step, _ in saved[1]] == steps
    assert [path for _, path in saved[0]] == [path for _, path in saved[1]]  # one shared checkpoint
    for _, path in saved[0]:
        assert (reference.cwd / path / "manifest.json").is_file()


# (fail_at, fail_rank): a worker dies just after a checkpoint (4, 8), just before one (7, 11) or between
# (5); rank 0 (the elected writer) and rank 1 in each position. (Ten runs repeated these five cases.)
KILLS = [(4, 1), (7, 1), (8, 0), (11, 0), (5, 0)]


@pytest.mark.timeout(1200)
def test_runs_with_a_killed_worker_all_finish_and_match_the_reference(reference: Run, tmp_path: Path) -> None:
    """Restarts that never hang: examples/train.py starts its group with elastic.init_process_group()
    (pytorch/pytorch#135712 made plain restarts on torchrun's shared store fail or hang)."""
    for i, (fail_at, fail_rank) in enumerate(KILLS):
        where = f"run {i} (worker {fail_rank} dies at step {fail_at})"
        kill = ["--fail-at", str(fail_at), "--fail-rank", str(fail_rank)]
        run = standalone(tmp_path / f"run{i}", 2, "--ckpt", "ckpt", *kill)
        deaths = [line for line in run.lines() if "injected failure" in line]
        assert deaths == [f"[rank {fail_rank}] injected failure: dying at step {fail_at}"], where
        resumed = SAVE_EVERY * (fail_at // SAVE_EVERY)  # the last checkpoint before the failure
        for rank in (0, 1):
            before, e = run.elections(rank)  # one election per attempt
            assert (before.attempt, before.src, before.path, before.tenure) == (0, 0, None, "0"), where
            assert (e.attempt, e.src, e.tenure, e.step, e.world) == (1, 0, str(resumed), resumed, 2), where
            assert e.path == dict(run.checkpoints()[fail_rank])[resumed], where
            assert e.own != e.elected, where  # fresh random weights, replaced by the checkpoint's
        assert_matches_reference(run, reference)


@pytest.mark.timeout(400)
def test_two_agents_with_node_local_dirs_survive_a_replaced_machine(reference: Run, tmp_path: Path) -> None:
    """Two torchrun agents on this host are two nodes (c10d rendezvous, one worker each), checkpointing
    into their own directory `nodes/{node}` with scope="node". Worker 1 deletes its node's directory and
    dies at step 10 (a machine replaced by one with an empty disk): the group resumes from the other
    node's most tenured checkpoint (step 8) and ends bit-identical to the reference run."""
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    agent = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d"]
    agent += [f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
    script = [str(EXAMPLE), *TRAIN, "--ckpt", "nodes/{node}", "--fail-at", "10", "--fail-rank", "1"]
    script += ["--fail-wipe"]
    launches = [[*agent, f"--rdzv-conf=is_host={host}", *script] for host in (1, 0)]
    first, second = torchrun([tmp_path, tmp_path], launches, share_store=False)
    run = Run(tmp_path, first.output + "\n" + second.output)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in run.output  # launched as documented: no warning

    saved = run.checkpoints()
    node_dir = {rank: Path(saved[rank][0][1]).parent for rank in (0, 1)}
    assert node_dir[0] != node_dir[1]
    assert {d.parent for d in node_dir.values()} == {Path("nodes")}  # nodes/<GROUP_RANK> of each agent
    for rank in (0, 1):  # both directories received every checkpoint, node 1's again after its rebirth
        assert [step for step, _ in saved[rank]] == [4, 8, 12], run.output
        assert {Path(path).parent for _, path in saved[rank]} == {node_dir[rank]}
    assert f"[rank 1] injected failure: deleted {node_dir[1]}" in run.lines()
    assert "[rank 1] injected failure: dying at step 10" in run.lines()

    survivor_ckpt8 = saved[0][1][1]
    for rank in (0, 1):  # the restart count of the survivor's agent may stay 0: compare the elections
        before, after = run.elections(rank)
        assert (before.attempt, before.src, before.tenure) == (0, 0, "0"), run.output
        assert (after.src, after.path, after.tenure, after.step, after.world) == (
            0,
            survivor_ckpt8,
            "8",
            8,
            2,
        )
        assert after.own != after.elected
    assert sorted(p.name for p in (tmp_path / node_dir[1]).iterdir()) == [Path(saved[1][2][1]).name]
    assert sorted(p.name for p in (tmp_path / node_dir[0]).iterdir()) == sorted(
        Path(path).name for _, path in saved[0]
    )
    assert_matches_reference(run, reference)


@pytest.mark.timeout(300)
def test_per_worker_dirs_survive_a_deleted_directory(reference: Run, tmp_path: Path) -> None:
    """One agent, two workers, each with its own directory `ckpt/{rank}` (scope="rank"). Worker 1
    deletes its directory and dies at step 10: the group resumes from worker 0's checkpoint of step 8, the
    most tenured that remains, and ends bit-identical to the reference run."""
    args = ["--ckpt", "ckpt/{rank}", "--fail-at", "10", "--fail-rank", "1", "--fail-wipe"]
    run = standalone(tmp_path, 2, *args)
    saved = run.checkpoints()
    for rank in (0, 1):
        assert [step for step, _ in saved[rank]] == [4, 8, 12], run.output
        assert {Path(path).parent for _, path in saved[rank]} == {Path(f"ckpt/{rank}")}
    assert "[rank 1] injected failure: deleted ckpt/1" in run.lines()
    for rank in (0, 1):
        _, after = run.elections(rank)
        assert (after.src, after.path, after.tenure, after.step) == (0, saved[0][1][1], "8", 8), run.output
    assert sorted(p.name for p in (tmp_path / "ckpt" / "1").iterdir()) == [Path(saved[1][2][1]).name]
    assert_matches_reference(run, reference)


@pytest.mark.timeout(300)
def test_restart_with_three_workers_rescales_the_learning_rate(reference: Run, tmp_path: Path) -> None:
    """A second torchrun invocation with 3 workers on the reference's checkpoints resumes from step 12 and
    on_sync sees the new world size."""
    shutil.copytree(reference.cwd / "ckpt", tmp_path / "ckpt")
    run = standalone(tmp_path, 3, "--ckpt", "ckpt", "--steps", "16", restarts=0)
    last = reference.checkpoints()[0][-1][1]
    elections = sorted(run.elections())
    assert [e.rank for e in elections] == [0, 1, 2]
    for e in elections:
        assert (e.attempt, e.path, e.tenure, e.step, e.world) == (0, last, "12", 12, 3)
    before = reference.out(0)
    old_lr = before["optimizer"]["param_groups"][0]["lr"]
    for rank in range(3):
        assert f"[rank {rank}] world size 2 -> 3: learning rate x1.5 (now {old_lr * 1.5:.4g})" in run.lines()

    final = run.out(0)
    assert final["world_size"] == 3
    assert final["optimizer"]["param_groups"][0]["lr"] == old_lr * 1.5
    assert (final["step"], final["samples"]) == (16, 16 * BATCH)
    assert final["history"][:STEPS] == before["history"]  # the past came with the checkpoint
    assert len(final["history"]) == 16
    newest = run.checkpoints()[0][-1][1]
    manifest = json.loads((tmp_path / newest / "manifest.json").read_text())
    assert manifest["world_size"] == 3
