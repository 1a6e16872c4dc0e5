"""`elastic.spawn`: run a function on N local workers, from a script or a notebook.

The engine is torch's own launcher (`torch.distributed.launcher.api.elastic_launch`, the code behind
torchrun): one local agent, c10d rendezvous on a free loopback port, `max_restarts` as torchrun counts
them. What it adds:

- Workers are fresh interpreters (``python -c``) that read ``(fn, args, kwargs)`` from a cloudpickle file,
  so functions from a notebook or ``__main__``, lambdas and closures work, and the caller's ``__main__`` is
  never imported again (no ``if __name__ == "__main__"`` guard needed). Results and exceptions come back
  through files in a private temporary directory.
- Output: the launcher's "tee" writes each worker's stdout/stderr to a file and copies every line, as it
  arrives, into the caller's ``sys.stdout``/``sys.stderr`` objects (a notebook cell, pytest's capture)
  with the prefix ``[rank N] ``.
- Deadline: a rendezvous handler wrapping torch's c10d handler checks the deadline each time the agent
  polls it (every monitor interval), so `timeout` stops the agent, which stops the workers.
- Cleanup: the caller's signal handlers and environment, which the launcher replaces, are restored;
  workers die with the caller (Linux ``PR_SET_PDEATHSIG``); any worker still alive at the end is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import cloudpickle

from elastic._util.errors import WorkerError
from elastic._util.procs import running
from elastic._util.timeouts import as_timedelta
from elastic.recovery.store import RDZV_ENV, format_address, serve

__all__ = ["spawn"]

log = logging.getLogger("elastic")

#: Name under which the deadline-aware rendezvous backend is registered with torch's registry.
_RDZV_BACKEND = "elastic-spawn"
#: What each worker interpreter runs; the payload path is its first argument.
_WORKER_CODE = "from elastic.launch.spawn import _worker_main; _worker_main()"
#: Seconds between the agent's checks of its workers (torchrun's default).
_MONITOR_INTERVAL = 0.1
#: Seconds a stopped worker gets between SIGTERM and SIGKILL (torch versions that let us choose).
_SHUTDOWN_TIMEOUT = 5
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
#: torch's intra-op thread pools default to the core count in every worker: with several workers on one
#: host they oversubscribe the cores (3 workers on 2 cores ran 5x slower). torchrun sets this too.
_THREADS_ENV = "OMP_NUM_THREADS"
_threads_said = False


class _Deadline(Exception):
    """Raised inside the launcher's agent loop when a spawn's `timeout` has passed."""


@dataclasses.dataclass
class _Run:
    deadline: float | None  # time.monotonic() value, or None for no deadline
    timed_out: bool = False

    def check(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.timed_out = True
            raise _Deadline


_RUNS: dict[str, _Run] = {}
_RUNS_LOCK = threading.Lock()
_REGISTERED = False


def _rendezvous_handler_class() -> type:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class DeadlineRendezvousHandler(RendezvousHandler):
        """torch's c10d rendezvous handler that stops the agent once the spawn's deadline has passed."""

        def __init__(self, inner: Any, run: _Run) -> None:
            self._inner = inner
            self._run = run

        def get_backend(self) -> str:
            return _RDZV_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return bool(getattr(self._inner, "use_agent_store", False))

        def next_rendezvous(self) -> Any:
            self._run.check()
            return self._inner.next_rendezvous()

        def num_nodes_waiting(self) -> int:
            self._run.check()  # the agent calls this every monitor interval while workers run
            return int(self._inner.num_nodes_waiting())

        def is_closed(self) -> bool:
            return bool(self._inner.is_closed())

        def set_closed(self) -> None:
            self._inner.set_closed()

        def get_run_id(self) -> str:
            return str(self._inner.get_run_id())

        def shutdown(self) -> bool:
            return bool(self._inner.shutdown())

    return DeadlineRendezvousHandler


def _create_rendezvous_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    with _RUNS_LOCK:
        run = _RUNS[params.run_id]
    inner_params = copy.copy(params)
    inner_params.backend = "c10d"
    inner = rendezvous_handler_registry.create_handler(inner_params)
    return _rendezvous_handler_class()(inner, run)


def _register_backend() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(_RDZV_BACKEND, _create_rendezvous_handler)
    _REGISTERED = True


# --------------------------------------------------------------------------------------------------------
# Caller side
# --------------------------------------------------------------------------------------------------------


class _Demote(logging.Filter):
    """Turns torchelastic's log records (restarts, SIGTERMs sent, ...) into DEBUG records of "elastic"."""

    def filter(self, record: logging.LogRecord) -> bool:
        log.debug("torchelastic: %s", record.getMessage())
        return False


_DEMOTE = _Demote()
_DEMOTE_LOCK = threading.Lock()
_DEMOTE_USERS = 0


def _torchelastic_loggers() -> list[logging.Logger]:
    names = [
        name
        for name, obj in logging.Logger.manager.loggerDict.items()
        if isinstance(obj, logging.Logger)
        and (name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"))
    ]
    return [logging.getLogger(name) for name in names]


@contextlib.contextmanager
def _quiet_torchelastic() -> Iterator[None]:
    """The launcher logs every restart and signal it sends at WARNING; spawn reports failures itself."""
    global _DEMOTE_USERS
    with _DEMOTE_LOCK:
        _DEMOTE_USERS += 1
        loggers = _torchelastic_loggers()
        for lg in loggers:
            if _DEMOTE not in lg.filters:
                lg.addFilter(_DEMOTE)
    try:
        yield
    finally:
        with _DEMOTE_LOCK:
            _DEMOTE_USERS -= 1
            if _DEMOTE_USERS == 0:
                for lg in _torchelastic_loggers():
                    lg.removeFilter(_DEMOTE)


@contextlib.contextmanager
def _keep_signals_and_env() -> Iterator[None]:
    """Undo what the launcher does to the caller: signal handlers and one environment variable."""
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for name in _SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                handler = signal.getsignal(sig)
                if handler is not None:
                    saved[sig] = handler
    env_key = "TORCHELASTIC_SIGNALS_TO_HANDLE"
    env_before = os.environ.get(env_key)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, handler)
        if env_before is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = env_before


@contextlib.contextmanager
def _worker_threads(nprocs: int) -> Iterator[None]:
    """``OMP_NUM_THREADS=1`` in the workers' environment while several share this host and the user set
    none, as torchrun does; said once per process. The caller's environment is restored afterwards."""
    global _threads_said
    if nprocs < 2 or _THREADS_ENV in os.environ:
        yield
        return
    if not _threads_said:
        _threads_said = True
        log.warning(
            "elastic.spawn: setting %s=1 for its %d workers (they share this host's %s cores); set %s "
            "yourself to choose another value",
            _THREADS_ENV,
            nprocs,
            os.cpu_count() or "?",
            _THREADS_ENV,
        )
    os.environ[_THREADS_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(_THREADS_ENV, None)


def _check_args(
    fn: Any, nprocs: Any, args: Any, kwargs: Any, backend: Any, max_restarts: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not callable(fn):
        msg = f"elastic.spawn(fn, ...): fn must be callable, got {fn!r}"
        raise TypeError(msg) from None
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        msg = f"elastic.spawn(nprocs=...) must be a positive int, got {nprocs!r}"
        raise ValueError(msg) from None
    if not isinstance(args, (tuple, list)):
        msg = f"elastic.spawn(args=...) must be a tuple of positional arguments, got {type(args).__name__}"
        raise TypeError(msg) from None
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        msg = f"elastic.spawn(kwargs=...) must be a dict of keyword arguments or None, got {kwargs!r}"
        raise TypeError(msg) from None
    if not isinstance(backend, str) or not backend:
        msg = f"elastic.spawn(backend=...) must be a backend name such as 'gloo' or 'nccl', got {backend!r}"
        raise TypeError(msg) from None
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        msg = f"elastic.spawn(max_restarts=...) must be an int >= 0, got {max_restarts!r}"
        raise ValueError(msg) from None
    return tuple(args), kwargs


def _write_payload(
    path: Path, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: dict[str, Any]
) -> None:
    try:
        body = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        msg = (
            f"elastic.spawn could not pickle fn, args or kwargs with cloudpickle ({type(exc).__name__}: "
            f"{exc}); pass values that can be pickled (open files, locks and sockets cannot)"
        )
        raise TypeError(msg) from None
    with open(path, "wb") as f:
        pickle.dump([str(p) for p in sys.path], f)  # plain strings: read before anything is unpickled
        pickle.dump(config, f)
        f.write(body)


def _launch_config(run_id: str, nprocs: int, max_restarts: int, logs_dir: Path) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    optional: dict[str, Any] = {"shutdown_timeout": _SHUTDOWN_TIMEOUT}
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=run_id,
        rdzv_backend=_RDZV_BACKEND,
        rdzv_endpoint="127.0.0.1:0",  # port 0: the agent's store binds a free port, fresh for each call
        max_restarts=max_restarts,
        monitor_interval=_MONITOR_INTERVAL,
        logs_specs=DefaultLogsSpecs(log_dir=str(logs_dir), tee=Std.ALL),
        log_line_prefix_template="[rank ${rank}] ",
        **{k: v for k, v in optional.items() if k in known},
    )


def _files(tmp: Path, kind: str) -> dict[tuple[int, int], Path]:
    """`{(restart, rank): path}` of the `kind` ("pid", "result", "error") files the workers wrote."""
    found = {}
    for path in tmp.glob(f"{kind}-*-*"):
        parts = path.name.split("-")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            found[(int(parts[1]), int(parts[2]))] = path
    return found


def _proc_path(pid: int, what: str) -> Path:
    return Path("/proc") / str(pid) / what


def _kill_leftovers(tmp: Path, payload: Path) -> None:
    """Kill (and reap) any worker of this call still alive; normally the launcher has stopped them all."""
    if not Path("/proc/self").exists():
        return
    for path in _files(tmp, "pid").values():
        try:
            pid = int(path.read_text())
            cmdline = _proc_path(pid, "cmdline").read_bytes()
            stat = _proc_path(pid, "stat").read_text()
        except (OSError, ValueError):
            continue  # gone
        if str(payload).encode() not in cmdline:
            continue  # the pid now belongs to another process
        if stat.rsplit(")", 1)[-1].split()[0] != "Z":
            log.warning("spawn: worker process %d outlived its agent; killing it", pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)


def _signal_name(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _worker_error(
    tmp: Path, failures: dict[int, Any], nprocs: int, max_restarts: int, timed_out: float | None
) -> WorkerError:
    """The WorkerError describing the last attempt's first failure (`failures`: rank -> ProcessFailure)."""
    pids = _files(tmp, "pid")
    last = max((restart for restart, _ in pids), default=0)
    records = []
    for (restart, _rank), path in _files(tmp, "error").items():
        if restart == last:
            with contextlib.suppress(Exception), open(path, "rb") as f:
                records.append(pickle.load(f))
    restarts = f" after {last} restart(s)" if last else ""
    # SIGTERM/SIGKILL are what the agent sends the survivors of a failure; a rank that died without an
    # exception by other means, or that a raising rank saw dead before it failed, is a silent death.
    stopped = (-signal.SIGTERM, -signal.SIGKILL)
    recorded = {r["rank"] for r in records}
    seen_dead = {peer for r in records for peer in r.get("dead_peers", ())}
    silent = {
        rank: f.exitcode
        for rank, f in sorted(failures.items())
        if rank not in recorded and (f.exitcode not in stopped or rank in seen_dead)
    }
    also = "".join(f"; rank {r} exited with {_signal_name(code)}" for r, code in silent.items())
    if timed_out is not None:
        msg = (
            f"elastic.spawn timed out after {timed_out:g} s{restarts}: all {nprocs} workers were stopped. "
            "Raise timeout=, or look for a worker that hangs (a collective some rank never joins)"
        )
        return WorkerError(msg, exc_type="TimeoutError", exc_message=msg)
    # A record whose rank saw a peer already dead (a broken connection) is a consequence, not a cause.
    causes = [r for r in records if not r.get("dead_peers")] or ([] if silent else records)
    if causes:
        first = min(causes, key=lambda r: r["time"])
        rank = first["rank"]
        msg = (
            f"rank {rank} raised {first['type']}: {first['message']}{restarts}{also}\n"
            f"(the other workers were stopped)\n\nTraceback of rank {rank}:\n{first['traceback']}"
        )
        return WorkerError(
            msg,
            rank=rank,
            exc_type=first["type"],
            exc_message=first["message"],
            remote_traceback=first["traceback"],
        )
    if failures:
        candidates = list(silent) or list(failures)
        rank = min(candidates, key=lambda r: (failures[r].exitcode in stopped, failures[r].timestamp, r))
        code = failures[rank].exitcode
        how = _signal_name(code)
        others = "".join(
            f"; rank {r['rank']} then raised {r['type']}: {r['message'].strip()}"
            for r in sorted(records, key=lambda r: r["rank"])
        )
        msg = (
            f"rank {rank} exited with {how} without raising a Python exception{restarts} "
            f"(killed, out of memory, os._exit?){others}; the other workers were stopped"
        )
        return WorkerError(msg, rank=rank, exc_type=None, exc_message=how)
    msg = f"elastic.spawn: the workers failed{restarts} without reporting why (max_restarts={max_restarts})"
    return WorkerError(msg)


def _results(tmp: Path, nprocs: int) -> list[Any]:
    pids = _files(tmp, "pid")
    last = max((restart for restart, _ in pids), default=0)
    found = _files(tmp, "result")
    missing = [r for r in range(nprocs) if (last, r) not in found]
    if missing:
        msg = (
            f"elastic.spawn: ranks {missing} exited with code 0 but returned nothing (did fn call os._exit?)"
        )
        raise WorkerError(msg, rank=missing[0]) from None
    out = []
    for rank in range(nprocs):
        try:
            out.append(cloudpickle.loads(found[(last, rank)].read_bytes()))
        except Exception as exc:
            msg = (
                f"elastic.spawn: the value returned by rank {rank} could not be unpickled here "
                f"({type(exc).__name__}: {exc}); return plain data (tensors, numbers, dicts) instead"
            )
            raise WorkerError(msg, rank=rank, exc_type=type(exc).__name__, exc_message=str(exc)) from exc
    return out


def spawn(
    fn: Callable[..., Any],
    nprocs: int = 2,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    backend: str = "gloo",
    max_restarts: int = 0,
    timeout: timedelta | float | None = None,
    restart: str = "group",
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on `nprocs` local workers and return their results in rank order.

    Each worker is a fresh Python process with the default process group initialised
    (`elastic.init_process_group(backend)`) and torchrun's environment variables (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``, ...). `fn`, `args` and `kwargs` travel
    with cloudpickle, so functions defined in a notebook or in ``__main__``, lambdas and closures work.
    Every line the workers print appears in this process's ``sys.stdout``/``sys.stderr``, prefixed
    ``[rank N] ``.

    A worker that raises stops the others. No worker process outlives the call, also on
    ``KeyboardInterrupt``. Each call picks a free port, so calls can repeat in one kernel. When several
    workers share the host and ``OMP_NUM_THREADS`` is not set, it is set to 1 for them (as torchrun
    does), with a note once.

    ``restart="worker"`` is for an `fn` that calls `elastic.run`: this process serves the rendezvous
    store (``ELASTIC_RDZV`` is set for the workers; no process group is started for them) and restarts
    only a worker that dies or raises, in its slot, while the others go on. A worker learns its slot
    from ``ELASTIC_SLOT`` and its life in it (0 first) from ``ELASTIC_SLOT_RESTARTS``; its output is
    prefixed ``[rank <slot>] ``.

    Args:
        fn: the function every worker runs; may be a lambda, a closure or defined in ``__main__``.
        nprocs: the number of workers.
        args: positional arguments of `fn`.
        kwargs: keyword arguments of `fn`.
        backend: the process group's backend (``"nccl"`` gives each worker the CUDA device of its
            ``LOCAL_RANK``); with ``restart="worker"`` only ``"gloo"`` (the default) is accepted:
            `elastic.run` picks each generation's backend itself.
        max_restarts: with ``restart="group"``, how many times the whole group is restarted on a
            failure, as torchrun does (workers see ``TORCHELASTIC_RESTART_COUNT``); with
            ``restart="worker"``, how many times each slot is restarted.
        timeout: bound of the whole run (seconds or ``timedelta``; None: no bound).
        restart: ``"group"`` (restart every worker) or ``"worker"`` (restart only the one that failed).

    Returns:
        The workers' results in rank order; with ``restart="worker"``, each slot's final result in slot
        order (None for a worker that left).

    Raises:
        WorkerError: a worker raised or died with no restart left (with the rank, the exception's type
            and message and the remote traceback; with ``restart="worker"``, after the other workers
            finished), or the run exceeded `timeout`.
        TypeError: `fn` is not callable, or `args`, `kwargs` or `backend` have the wrong type.
        ValueError: `nprocs`, `max_restarts` or `restart` out of range, or a `backend` other than
            ``"gloo"`` with ``restart="worker"``.
    """
    if restart not in ("group", "worker"):
        msg = f"elastic.spawn(restart=...) must be 'group' or 'worker', got {restart!r}"
        raise ValueError(msg)
    args, kwargs = _check_args(fn, nprocs, args, kwargs, backend, max_restarts)
    if restart == "worker" and backend != "gloo":
        msg = (
            f"elastic.spawn(backend={backend!r}, restart='worker'): with restart='worker' no process group "
            f"is started for the workers: elastic.run makes one per generation and picks its backend itself "
            f"(NCCL when the state holds CUDA tensors, else gloo); drop backend= or use restart='group'"
        )
        raise ValueError(msg)
    td = as_timedelta(timeout, "elastic.spawn")
    seconds = None if td is None else td.total_seconds()
    with _worker_threads(nprocs):
        if restart == "worker":
            return _spawn_workers(fn, nprocs, args, kwargs, max_restarts, seconds)
        return _spawn_group(fn, nprocs, args, kwargs, backend, max_restarts, seconds)


def _spawn_group(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str,
    max_restarts: int,
    seconds: float | None,
) -> list[Any]:

    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401  (its logger, early)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _register_backend()
    tmp = Path(tempfile.mkdtemp(prefix="elastic-spawn-"))
    payload = tmp / "payload.pkl"
    run_id = f"elastic-spawn-{uuid.uuid4().hex[:12]}"
    run = _Run(deadline=None if seconds is None else time.monotonic() + seconds)
    try:
        worker_config = {
            "backend": backend,
            "timeout": seconds,
            "out_dir": str(tmp),
            "max_restarts": max_restarts,
            "parent": os.getpid(),
        }
        _write_payload(payload, fn, args, kwargs, worker_config)
        config = _launch_config(run_id, nprocs, max_restarts, tmp / "logs")
        with _RUNS_LOCK:
            _RUNS[run_id] = run
        log.debug("spawn %s: %d workers, backend %s, max_restarts %d", run_id, nprocs, backend, max_restarts)
        try:
            with _keep_signals_and_env(), _quiet_torchelastic():
                elastic_launch(config, sys.executable)("-c", _WORKER_CODE, str(payload))
        except ChildFailedError as exc:
            raise _worker_error(tmp, dict(exc.failures), nprocs, max_restarts, None) from None
        except _Deadline:
            raise _worker_error(tmp, {}, nprocs, max_restarts, seconds) from None
        except SignalException as exc:
            # The launcher turned a signal sent to this process into an exception after stopping the
            # workers; now that the caller's handlers are back, deliver it again the caller's way.
            # (SIGINT with Python's default handler becomes KeyboardInterrupt here.)
            sig = exc.sigval
            signal.raise_signal(sig)
            msg = f"elastic.spawn was interrupted by {signal.Signals(sig).name}; every worker was stopped"
            raise WorkerError(msg) from None
        return _results(tmp, nprocs)
    finally:
        with _RUNS_LOCK:
            _RUNS.pop(run_id, None)
        _kill_leftovers(tmp, payload)
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------
# restart="worker": this process serves the rendezvous store and restarts single workers in their slots
# --------------------------------------------------------------------------------------------------------

#: Environment variables of a worker started with restart="worker": its slot, and its life in the slot.
_SLOT_ENV = "ELASTIC_SLOT"
_LIFE_ENV = "ELASTIC_SLOT_RESTARTS"
#: Seconds between two looks at the workers.
_POLL = 0.02


class _Pump(threading.Thread):
    """Copies a worker's pipe, line by line as it arrives, into the caller's stream with a prefix."""

    def __init__(self, pipe: Any, stream: Any, prefix: str, lock: threading.Lock) -> None:
        super().__init__(daemon=True, name=f"elastic-spawn-output {prefix.strip()}")
        self._pipe = pipe
        self._stream = stream
        self._prefix = prefix
        self._lock = lock

    def run(self) -> None:
        with contextlib.suppress(Exception):
            for raw in iter(self._pipe.readline, b""):
                line = raw.decode(errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                with self._lock, contextlib.suppress(Exception):
                    self._stream.write(self._prefix + line)
                    self._stream.flush()
        with contextlib.suppress(Exception):
            self._pipe.close()


@dataclasses.dataclass
class _Slot:
    index: int
    life: int = 0
    proc: Any = None
    pumps: list[_Pump] = dataclasses.field(default_factory=list)
    #: the pumps of earlier lives, still copying what a dead worker's forked children print
    old_pumps: list[_Pump] = dataclasses.field(default_factory=list)
    done: bool = False
    error: WorkerError | None = None
    failed_at: float = 0.0


def _slot_failure(tmp: Path, slot: _Slot, exitcode: int) -> WorkerError:
    """What ended life `slot.life` of `slot`: its exception, or how the process exited."""
    path = tmp / f"error-{slot.life}-{slot.index}"
    lives = f" in life {slot.life} of its slot" if slot.life else ""
    if path.exists():
        with contextlib.suppress(Exception), open(path, "rb") as f:
            rec = pickle.load(f)
            msg = (
                f"slot {slot.index} raised {rec['type']}: {rec['message']}{lives}\n\n"
                f"Traceback of slot {slot.index}:\n{rec['traceback']}"
            )
            return WorkerError(
                msg,
                rank=slot.index,
                exc_type=rec["type"],
                exc_message=rec["message"],
                remote_traceback=rec["traceback"],
            )
    how = _signal_name(exitcode)
    msg = (
        f"slot {slot.index} exited with {how} without raising a Python exception{lives} "
        "(killed, out of memory, os._exit?)"
    )
    return WorkerError(msg, rank=slot.index, exc_type=None, exc_message=how)


def _start_slot(
    slot: _Slot, payload: Path, env: dict[str, str], lock: threading.Lock, out: Any, err: Any
) -> None:
    import subprocess

    child_env = dict(env)
    child_env[_SLOT_ENV] = str(slot.index)
    child_env[_LIFE_ENV] = str(slot.life)
    child_env["LOCAL_RANK"] = str(slot.index)
    slot.proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER_CODE, str(payload)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env,
    )
    prefix = f"[rank {slot.index}] "
    slot.old_pumps += [pump for pump in slot.pumps if pump.is_alive()]
    slot.pumps = [_Pump(slot.proc.stdout, out, prefix, lock), _Pump(slot.proc.stderr, err, prefix, lock)]
    for pump in slot.pumps:
        pump.start()


def _stop_slots(slots: list[_Slot]) -> None:
    """SIGKILL every worker still running and reap it; wait for the output to drain."""
    for slot in slots:
        if slot.proc is not None and slot.proc.poll() is None:
            with contextlib.suppress(OSError):
                slot.proc.kill()
    for slot in slots:
        if slot.proc is not None:
            with contextlib.suppress(Exception):
                slot.proc.wait(timeout=10)
        for pump in [*slot.pumps, *slot.old_pumps]:
            pump.join(timeout=5)


def _spawn_workers(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    max_restarts: int,
    seconds: float | None,
) -> list[Any]:
    deadline = None if seconds is None else time.monotonic() + seconds
    tmp = Path(tempfile.mkdtemp(prefix="elastic-spawn-"))
    payload = tmp / "payload.pkl"
    slots = [_Slot(index=i) for i in range(nprocs)]
    store = None
    lock = threading.Lock()
    out, err = sys.stdout, sys.stderr
    try:
        config = {
            "mode": "worker",
            "backend": "gloo",
            "timeout": seconds,
            "out_dir": str(tmp),
            "max_restarts": max_restarts,
            "parent": os.getpid(),
        }
        _write_payload(payload, fn, args, kwargs, config)
        store = serve("127.0.0.1", 0, timeout=timedelta(seconds=60))
        address = format_address("127.0.0.1", store.port)
        env = dict(os.environ)
        env[RDZV_ENV] = address
        env["PYTHONUNBUFFERED"] = "1"
        log.debug(
            "spawn: %d workers, restart='worker', store %s, max_restarts %d", nprocs, address, max_restarts
        )
        for slot in slots:
            _start_slot(slot, payload, env, lock, out, err)
        while not all(s.done for s in slots):
            if deadline is not None and time.monotonic() >= deadline:
                msg = (
                    f"elastic.spawn timed out after {seconds:g} s: all {nprocs} workers were stopped. Raise "
                    "timeout=, or look for a worker that hangs"
                )
                raise WorkerError(msg, exc_type="TimeoutError", exc_message=msg) from None
            for slot in slots:
                if slot.done or slot.proc.poll() is None:
                    continue
                code = slot.proc.returncode
                # A dead worker's forked children (DataLoader workers) may hold its pipes open for seconds:
                # a restart does not wait for them (the pumps go on copying what they print meanwhile).
                finished = code == 0 and (tmp / f"result-{slot.life}-{slot.index}").exists()
                for pump in slot.pumps:
                    pump.join(timeout=5 if finished or slot.life >= max_restarts else 0.5)
                if finished:
                    slot.done = True
                    continue
                failure = _slot_failure(tmp, slot, code)
                if slot.life < max_restarts:
                    first = str(failure).splitlines()[0]
                    with lock, contextlib.suppress(Exception):
                        err.write(
                            f"[rank {slot.index}] elastic.spawn: {first}; restarting slot {slot.index} "
                            f"(restart {slot.life + 1} of {max_restarts})\n"
                        )
                    slot.life += 1
                    _start_slot(slot, payload, env, lock, out, err)
                    continue
                slot.done = True
                slot.error = failure
                slot.failed_at = time.monotonic()
            time.sleep(_POLL)
        failed = [s for s in slots if s.error is not None]
        if failed:
            worst = min(failed, key=lambda s: s.failed_at)
            assert worst.error is not None
            if max_restarts:
                worst.error.args = (f"{worst.error.args[0]}\n(after {max_restarts} restart(s) of the slot)",)
            raise worst.error
        results = []
        for slot in slots:
            path = tmp / f"result-{slot.life}-{slot.index}"
            try:
                results.append(cloudpickle.loads(path.read_bytes()))
            except Exception as exc:
                msg = (
                    f"elastic.spawn: the value returned by slot {slot.index} could not be unpickled here "
                    f"({type(exc).__name__}: {exc}); return plain data (tensors, numbers, dicts) instead"
                )
                raise WorkerError(
                    msg, rank=slot.index, exc_type=type(exc).__name__, exc_message=str(exc)
                ) from exc
        return results
    finally:
        _stop_slots(slots)
        del store  # the server stops with its last reference
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------
# Worker side (runs in ``python -c`` started by the launcher)
# --------------------------------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """Linux: be killed when the caller dies (e.g. a notebook kernel restarted with SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the caller died before prctl took effect
        os._exit(1)


def _write_atomic(path: Path, data: bytes) -> None:
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    os.replace(part, path)


def _dead_peers(out: Path, restart: int, rank: int, wait: float = 0.1) -> list[int]:
    """Ranks of this attempt whose process has already ended (polled for up to `wait` seconds).

    A rank whose collective broke because a peer died reports that peer here, so the caller can name the
    peer, not the broken connection, as the first failure.
    """
    peers = {r: p for (a, r), p in _files(out, "pid").items() if a == restart and r != rank}
    deadline = time.monotonic() + wait
    while True:
        dead = []
        for peer, path in sorted(peers.items()):
            try:
                pid = int(path.read_text())
            except (OSError, ValueError):
                continue
            if not running(pid):
                dead.append(peer)
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.01)


def _type_name(exc: BaseException) -> str:
    """``ValueError``, ``elastic.SyncError`` (the public name, not its module's), ``pkg.mod.Error``."""
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    top = sys.modules.get(cls.__module__.split(".")[0])
    if top is not None and getattr(top, cls.__qualname__, None) is cls:
        return f"{top.__name__}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _worker_main() -> None:
    import torch.distributed as dist

    if hasattr(signal, "SIGINT"):
        # Ctrl-C in a terminal or "interrupt kernel" reaches every worker: die quietly, the caller reports.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    with open(sys.argv[1], "rb") as f:
        caller_path = pickle.load(f)
        config = pickle.load(f)
        body = f.read()
    per_worker = config.get("mode") == "worker"
    if per_worker:
        rank = int(os.environ.get(_SLOT_ENV, "0"))
        restart = int(os.environ.get(_LIFE_ENV, "0"))
    else:
        rank = int(os.environ.get("RANK", "0"))
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _die_with_parent(config["parent"])
    out = Path(config["out_dir"])
    _write_atomic(out / f"pid-{restart}-{rank}", str(os.getpid()).encode())
    sys.path[:] = caller_path + [p for p in sys.path if p not in caller_path]

    from elastic.launch.process_group import init_process_group

    try:
        fn, args, kwargs = cloudpickle.loads(body)
        if not per_worker:  # restart="worker": fn calls elastic.run, which makes a group per generation
            init_process_group(config["backend"], timeout=config["timeout"])
        try:
            result = fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            result = None
        data = cloudpickle.dumps(result)
    except BaseException as exc:
        tb = traceback.format_exception(
            type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None
        )
        record = {
            "dead_peers": [] if per_worker else _dead_peers(out, restart, rank),
            "rank": rank,
            "restart": restart,
            "time": time.time(),
            "type": _type_name(exc),
            "message": str(exc),
            "traceback": "".join(tb),
        }
        _write_atomic(out / f"error-{restart}-{rank}", pickle.dumps(record))
        if restart < config["max_restarts"]:  # the caller never sees this failure: say it here, briefly
            lines = str(exc).strip().splitlines()
            text = lines[0] if lines else ""
            text = text if len(text) <= 160 else text[:157] + "..."
            again = "this worker in its slot" if per_worker else "the group"
            sys.stderr.write(
                f"attempt {restart} failed with {record['type']}: {text}; elastic.spawn restarts {again}\n"
            )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _write_atomic(out / f"result-{restart}-{rank}", data)
    if dist.is_initialized():
        dist.destroy_process_group()
    # Exit without tearing the interpreter down: a process that used a gloo group and imported
    # torch._dynamo (optimizers do) sometimes aborts in teardown ("terminate called without an active
    # exception", SIGABRT), which would turn a finished run into a failure. atexit callbacks still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
