"""`elastic.spawn`: any callable, rank order, live prefixed output, errors, timeout, restarts, cleanup.

Every spawn starts real worker interpreters (each imports torch), so checks that can share a run do.
After each run the test asserts that no worker process is left: neither a child of this process nor any
process whose pid a worker reported.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import attrs
import pytest
import torch

import elastic
from elastic import WorkerError

pytestmark = pytest.mark.skipif(not Path("/proc/self").exists(), reason="process checks read /proc")


def _all_children() -> list[int]:
    me = str(os.getpid())
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[-1].split()[1] == me:
                out.append(int(entry.name))
    return out


_before: set[int] = set()


@pytest.fixture(autouse=True)
def _children_before_the_test() -> None:
    """Children this process already had (e.g. multiprocessing's resource tracker from other tests)."""
    _before.clear()
    _before.update(_all_children())


def _children() -> list[int]:
    """Pids of this process's children started during the test, zombies included (a zombie is a child
    nobody reaped)."""
    return [p for p in _all_children() if p not in _before]


def _is_worker(pid: int) -> bool:
    """True while `pid` is still a spawn worker process (running or an unreaped zombie)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return b"elastic.launch.spawn" in cmdline or stat.rsplit(")", 1)[-1].split()[0] == "Z"


def _assert_no_workers_left(pids: list[int] = ()) -> None:  # type: ignore[assignment]
    assert _children() == []
    assert [p for p in pids if _is_worker(p)] == []


def _pids_in(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("pid-*")]


def _run_script(code: str, tmp_path: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )


ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")


@pytest.mark.timeout(120)
def test_closure_kwargs_rank_order_output_and_a_second_call(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    offset = 100  # captured by the closure
    folder = str(tmp_path)

    def work(scale: int, *, label: str) -> dict:
        import atexit

        import torch.distributed as dist

        rank = dist.get_rank()
        atexit.register(Path(folder, f"atexit-{rank}").write_text, "ran")
        print(f"hello from {label} {rank}")
        print(f"warning from {rank}", file=sys.stderr)
        return {
            "value": offset + scale * rank,
            "rank": rank,
            "world": dist.get_world_size(),
            "backend": dist.get_backend(),
            "env": {
                k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")
            },
            "pid": os.getpid(),
        }

    results = elastic.spawn(work, 3, args=(10,), kwargs={"label": "worker"})
    assert [r["value"] for r in results] == [100, 110, 120]
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["world"] for r in results} == {3}
    assert {r["backend"] for r in results} == {"gloo"}
    assert [r["env"] for r in results] == [
        {"RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": "3", "TORCHELASTIC_RESTART_COUNT": "0"}
        for i in range(3)
    ]
    assert os.getpid() not in {r["pid"] for r in results}
    captured = capsys.readouterr()
    for rank in range(3):
        assert f"[rank {rank}] hello from worker {rank}\n" in captured.out
        assert f"[rank {rank}] warning from {rank}\n" in captured.err
    _assert_no_workers_left([r["pid"] for r in results])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit-0", "atexit-1", "atexit-2"]

    # A second call in the same process: a lambda, a fresh port, same clean exit.
    again = elastic.spawn(lambda a, b: (a + b, os.getpid(), os.environ["MASTER_PORT"]), 2, args=(1, 2))
    assert [r[0] for r in again] == [3, 3]
    assert int(again[0][2]) > 0 and again[0][2] == again[1][2]
    _assert_no_workers_left([r[1] for r in again])


@pytest.mark.timeout(60)
def test_output_reaches_a_replaced_sys_stdout_while_workers_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook's sys.stdout is a Python object, not a file descriptor; lines arrive before the end."""

    class Recorder(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.first_line_at: float | None = None

        def write(self, s: str) -> int:
            if "[rank 1] started" in s and self.first_line_at is None:
                self.first_line_at = time.monotonic()
            return super().write(s)

    out, err = Recorder(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)

    def work(marker: str) -> int:
        import torch.distributed as dist

        print("started")
        # Stay alive until the caller has seen the line above (or give up after 30 s).
        deadline = time.monotonic() + 30
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("seen" if os.path.exists(marker) else "never seen")
        return dist.get_rank()

    marker = Path(os.environ.get("TMPDIR", "/tmp")) / f"elastic-spawn-seen-{os.getpid()}-{time.time_ns()}"

    def watch() -> None:
        give_up = time.monotonic() + 50
        while out.first_line_at is None and time.monotonic() < give_up:
            time.sleep(0.02)
        if out.first_line_at is not None:
            marker.write_text("seen")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = elastic.spawn(work, 2, args=(str(marker),))
    finally:
        marker.unlink(missing_ok=True)
    assert results == [0, 1]
    text = out.getvalue()
    assert "[rank 1] started\n" in text
    assert "[rank 0] seen\n" in text and "[rank 1] seen\n" in text  # the caller saw output mid-run
    assert "never seen" not in text
    _assert_no_workers_left()


SCRIPT_WITHOUT_GUARD = """
    import os
    import elastic

    print("top level ran in", os.getpid(), flush=True)

    def square(x):
        import torch.distributed as dist
        return (dist.get_rank(), x * x)

    print("results", elastic.spawn(square, 2, args=(7,)), flush=True)
"""


@pytest.mark.timeout(120)
def test_main_defined_function_from_a_fresh_interpreter_needs_no_guard(tmp_path: Path) -> None:
    done = _run_script(SCRIPT_WITHOUT_GUARD, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # __main__ ran once, in the caller; workers never re-import it.
    assert len([line for line in lines if "top level ran" in line]) == 1
    assert "results [(0, 49), (1, 49)]" in lines
    assert "Traceback" not in done.stderr

    code = textwrap.dedent(SCRIPT_WITHOUT_GUARD).replace("(7,)", "(3,)")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "results [(0, 9), (1, 9)]" in done.stdout.splitlines()
    _assert_no_workers_left()


def raise_on_rank_1(folder: str) -> None:
    import torch.distributed as dist

    Path(folder, f"pid-{dist.get_rank()}").write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        raise ValueError("bad learning rate -3")
    time.sleep(120)  # stopped by spawn when rank 1 fails


@pytest.mark.timeout(90)
def test_a_raising_worker_becomes_worker_error_and_the_others_stop(tmp_path: Path) -> None:
    with pytest.raises(WorkerError) as info:
        elastic.spawn(raise_on_rank_1, 2, args=(str(tmp_path),))
    err = info.value
    assert err.rank == 1
    assert err.exc_type == "ValueError"
    assert err.exc_message == "bad learning rate -3"
    assert err.remote_traceback is not None
    assert 'raise ValueError("bad learning rate -3")' in err.remote_traceback
    assert "in raise_on_rank_1" in err.remote_traceback
    assert "rank 1 raised ValueError: bad learning rate -3" in str(err)
    assert isinstance(err, elastic.ElasticError)
    pids = _pids_in(tmp_path)
    assert len(pids) == 2
    _assert_no_workers_left(pids)


@pytest.mark.timeout(60)
def test_a_worker_that_dies_without_an_exception_names_rank_and_exit_code() -> None:
    def die() -> None:
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(7)
        time.sleep(120)

    with pytest.raises(WorkerError) as info:
        elastic.spawn(die, 2)
    assert info.value.rank == 1
    assert info.value.exc_type is None
    assert "rank 1 exited with exit code 7" in str(info.value)
    _assert_no_workers_left()


@pytest.mark.timeout(90)
def test_a_hung_worker_is_stopped_by_the_timeout(tmp_path: Path) -> None:
    def hang(folder: str) -> None:
        import torch.distributed as dist

        Path(folder, f"pid-{dist.get_rank()}").write_text(str(os.getpid()))
        if dist.get_rank() == 0:
            dist.barrier()  # rank 1 never joins
        time.sleep(300)

    with pytest.raises(WorkerError, match=r"timed out after 8 s") as info:
        elastic.spawn(hang, 2, args=(str(tmp_path),), timeout=timedelta(seconds=8))
    assert info.value.exc_type == "TimeoutError"
    _assert_no_workers_left(_pids_in(tmp_path))


@elastic.elastic_state(tenure="step")
@attrs.define
class Counter:
    weight: torch.Tensor = attrs.field(factory=lambda: torch.zeros(3))
    step: int = 0


def train_with_a_crash(folder: str) -> dict:
    """Ten steps with a checkpoint every 4; on the first attempt rank 1 dies at step 6."""
    import torch.distributed as dist

    rank = dist.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    state = Counter()
    report = elastic.load(state, folder)
    resumed_from = state.step
    while state.step < 10:
        state.step += 1
        state.weight += 1.0
        if state.step % 4 == 0:
            elastic.save(state, folder)
        if attempt == 0 and rank == 1 and state.step == 6:
            os._exit(1)
    dist.barrier()
    return {
        "attempt": attempt,
        "source": report.source,
        "resumed_from": resumed_from,
        "step": state.step,
        "weight": state.weight.tolist(),
    }


@pytest.mark.timeout(120)
def test_max_restarts_restarts_the_group_which_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    results = elastic.spawn(train_with_a_crash, 2, args=(str(tmp_path),), max_restarts=2)
    expected = {"attempt": 1, "source": "checkpoint", "resumed_from": 4, "step": 10, "weight": [10.0] * 3}
    assert results == [expected, expected]
    _assert_no_workers_left()

    # Without restarts the same crash is an error.
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    with pytest.raises(WorkerError, match="rank 1 exited with exit code 1") as info:
        elastic.spawn(train_with_a_crash, 2, args=(str(tmp_path),))
    assert info.value.rank == 1
    _assert_no_workers_left()


INTERRUPTED = """
    import os, sys, time
    import elastic

    def hang(folder):
        import torch.distributed as dist
        open(os.path.join(folder, f"pid-{dist.get_rank()}"), "w").write(str(os.getpid()))
        time.sleep(300)

    try:
        elastic.spawn(hang, 2, args=(sys.argv[1],))
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
"""


def _sigint_default() -> None:
    """In the child, before Python starts: SIGINT as a terminal gives it. A shell's background job (CI
    started with ``&``) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_and_wait_for_workers(script: Path, folder: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(script), str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_default,
    )
    deadline = time.monotonic() + 60
    while len(list(folder.glob("pid-*"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.3)  # let the pid files be written completely
    return proc


@pytest.mark.timeout(150)
def test_interrupting_or_killing_the_caller_leaves_no_worker(tmp_path: Path) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent(INTERRUPTED))

    # Ctrl-C (SIGINT) reaches the caller only: KeyboardInterrupt after every worker is stopped.
    folder = tmp_path / "sigint"
    folder.mkdir()
    proc = _start_and_wait_for_workers(script, folder)
    pids = _pids_in(folder)
    assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else "workers did not start"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip().splitlines()[-1] == "KeyboardInterrupt"
    assert [p for p in pids if _is_worker(p)] == []

    # The caller killed outright (a notebook kernel restart): the workers die with it.
    folder = tmp_path / "sigkill"
    folder.mkdir()
    proc = _start_and_wait_for_workers(script, folder)
    pids = _pids_in(folder)
    assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else "workers did not start"
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(_is_worker(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _is_worker(p)] == []
    _assert_no_workers_left()


def test_bad_arguments_fail_before_any_process_starts() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        elastic.spawn(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"nprocs=\.\.\.\) must be a positive int, got 0"):
        elastic.spawn(print, 0)
    with pytest.raises(TypeError, match="timeout"):
        elastic.spawn(print, 2, timeout="soon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_restarts"):
        elastic.spawn(print, 2, max_restarts=-1)
    with pytest.raises(TypeError, match="kwargs"):
        elastic.spawn(print, 2, kwargs=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="could not pickle"):
        elastic.spawn(print, 2, args=(threading.Lock(),))
    assert _children() == []


def test_the_first_failure_is_a_silent_death_when_the_raising_rank_saw_it_dead(tmp_path: Path) -> None:
    """Rank 1 killed by SIGKILL (out of memory), rank 0 then raised on the broken connection."""
    import pickle
    from types import SimpleNamespace

    from elastic.launch.spawn import _worker_error

    for rank in range(2):
        (tmp_path / f"pid-0-{rank}").write_text(str(10 + rank))
    record = {
        "dead_peers": [1],
        "rank": 0,
        "restart": 0,
        "time": 5.0,
        "type": "RuntimeError",
        "message": "Connection closed by peer",
        "traceback": "...",
    }
    (tmp_path / "error-0-0").write_bytes(pickle.dumps(record))
    failures = {
        0: SimpleNamespace(exitcode=1, timestamp=5),
        1: SimpleNamespace(exitcode=-signal.SIGKILL, timestamp=5),
    }
    err = _worker_error(tmp_path, failures, 2, 0, None)
    assert err.rank == 1
    assert str(err).startswith("rank 1 exited with signal SIGKILL without raising a Python exception")
    assert "rank 0 then raised RuntimeError: Connection closed by peer" in str(err)

    # The same broken connection with no dead peer in sight is the cause itself.
    (tmp_path / "error-0-0").write_bytes(pickle.dumps({**record, "dead_peers": []}))
    err = _worker_error(tmp_path, failures, 2, 0, None)
    assert (err.rank, err.exc_type, err.exc_message) == (0, "RuntimeError", "Connection closed by peer")


def _refuse_here() -> None:
    raise ValueError("this value cannot be rebuilt in the caller")


class _OnlyThere:
    """Pickles in the worker; unpickling it in the caller raises."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_refuse_here, ())


def _return_only_there() -> _OnlyThere:
    return _OnlyThere()


@pytest.mark.parametrize("restart", ["group", "worker"])
def test_a_result_that_cannot_be_unpickled_keeps_the_cause(restart: str) -> None:
    with pytest.raises(WorkerError, match="could not be unpickled here") as info:
        elastic.spawn(_return_only_there, 1, restart=restart, timeout=100)
    assert isinstance(info.value.__cause__, ValueError)
    assert str(info.value.__cause__) == "this value cannot be rebuilt in the caller"
    _assert_no_workers_left()


# --------------------------------------------------------------------------------------------------------
# restart="worker": the store in the caller, single workers restarted in their slots


def _slot_worker(folder: str, fail_slot_2: bool) -> tuple[int, int, str, str, bool]:
    import torch.distributed as dist

    slot, life = int(os.environ["ELASTIC_SLOT"]), int(os.environ["ELASTIC_SLOT_RESTARTS"])
    Path(folder, f"pid-{slot}-{life}").write_text(str(os.getpid()))
    print(f"slot {slot} life {life}", flush=True)
    if slot == 1 and life == 0:
        os._exit(3)  # dies without an exception: restarted in its slot
    if slot == 2 and fail_slot_2:
        msg = f"slot 2 fails in life {life}"
        raise ValueError(msg)
    return slot, life, os.environ["ELASTIC_RDZV"], os.environ["LOCAL_RANK"], dist.is_initialized()


@pytest.mark.timeout(120)
def test_worker_restarts_happen_in_the_slot_and_results_come_in_slot_order(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    results = elastic.spawn(
        _slot_worker, 3, args=(str(tmp_path), False), restart="worker", max_restarts=1, timeout=100
    )
    assert [r[:2] for r in results] == [(0, 0), (1, 1), (2, 0)]  # slot order; slot 1 in its second life
    assert len({r[2] for r in results}) == 1 and results[0][2].startswith("127.0.0.1:")  # one store
    assert [r[3] for r in results] == ["0", "1", "2"]  # LOCAL_RANK is the slot
    assert not any(r[4] for r in results)  # no process group: fn calls elastic.run, which makes one
    out = capfd.readouterr()
    text = out.out + out.err
    assert "[rank 1] slot 1 life 0" in text and "[rank 1] slot 1 life 1" in text
    assert "slot 1 exited with exit code 3" in text and "restarting slot 1 (restart 1 of 1)" in text
    _assert_no_workers_left(_pids_in(tmp_path))

    # a slot that fails again with no restart left: WorkerError once the others are done
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(WorkerError, match="slot 2 raised ValueError: slot 2 fails in life 1") as info:
        elastic.spawn(_slot_worker, 3, args=(str(again), True), restart="worker", max_restarts=1, timeout=100)
    assert info.value.rank == 2 and info.value.exc_type == "ValueError"
    assert "after 1 restart(s) of the slot" in str(info.value)
    assert sorted(p.name for p in again.glob("pid-*")) == [
        "pid-0-0",
        "pid-1-0",
        "pid-1-1",
        "pid-2-0",
        "pid-2-1",
    ]
    _assert_no_workers_left(_pids_in(again))


INTERRUPTED_WORKERS = """
    import os, sys, time
    import elastic

    def hang(folder):
        open(os.path.join(folder, "pid-" + os.environ["ELASTIC_SLOT"]), "w").write(str(os.getpid()))
        time.sleep(300)

    try:
        elastic.spawn(hang, 2, args=(sys.argv[1],), restart="worker", max_restarts=3)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
"""


@pytest.mark.timeout(120)
def test_interrupting_a_worker_restart_spawn_leaves_no_worker(tmp_path: Path) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent(INTERRUPTED_WORKERS))
    proc = _start_and_wait_for_workers(script, tmp_path)
    pids = _pids_in(tmp_path)
    assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else "workers did not start"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip().splitlines()[-1] == "KeyboardInterrupt"
    assert [p for p in pids if _is_worker(p)] == []


def test_workers_sharing_a_host_get_one_thread_each_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from elastic.launch import spawn as _spawn

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(_spawn, "_threads_said", False)
    with caplog.at_level("WARNING", logger="elastic"):
        with _spawn._worker_threads(3):
            assert os.environ["OMP_NUM_THREADS"] == "1"
        with _spawn._worker_threads(3):
            assert os.environ["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in os.environ  # the caller's environment is as it was
    said = [r.getMessage() for r in caplog.records if "OMP_NUM_THREADS=1" in r.getMessage()]
    assert len(said) == 1 and "3 workers" in said[0]  # said once
    with _spawn._worker_threads(1):
        assert "OMP_NUM_THREADS" not in os.environ  # one worker: torch's default
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    with _spawn._worker_threads(3):
        assert os.environ["OMP_NUM_THREADS"] == "4"  # the user's choice stays
