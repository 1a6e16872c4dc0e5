"""`elastic.run`: survivors keep their state in memory and re-form the group, losing at most one step.

Every worker process is one participant of a rendezvous (`._rendezvous`) over a TCPStore that outlives
the workers. `run` loops over *generations*; each one is

1. a membership from the rendezvous (generation number, rank, size, a store prefix never used before),
2. a fresh default process group on that prefix (gloo; NCCL when the state holds CUDA tensors),
3. `elastic.load(state, ckpt)` when `ckpt` is given, else `elastic.sync(state)` (the most tenured wins),
4. ``fn(state, world)``.

A generation ends in one of four ways:

- ``fn`` returns: the run is finished (`Rendezvous.finish`); `run` returns the value.
- `World.check` sees, in its flag exchange, that someone waits to join or leaves (SIGTERM): every rank
  leaves at the same call; the leaver's `run` returns ``None``, the others form the next generation.
- A communication failure caused by a peer (it died, hung past `timeout`, aborted its group): the group
  is aborted and destroyed and the next generation forms.
- Any other exception: this rank announces it, aborts its group (so the peers notice in milliseconds)
  and the exception propagates out of `run`.

Classifying a failure. Gloo reports a dead or hung peer as a plain ``RuntimeError``, and user code raises
``RuntimeError`` too, so the type alone decides nothing. An exception counts as a peer's failure only when
the group's state shows it (`_evidence`): a member whose heartbeat stopped (`Rendezvous.alive`), a member
that announced the end of this generation under the generation's store prefix (every rank announces why
it leaves a generation, *after* deciding, so announcements are always grounded in a real failure), or a
broken gloo pair ("Connection closed/reset by peer": the peer's process or group is gone; a local bug
cannot produce it). Without evidence within `_probe_seconds` the exception is the user's own and
propagates.

Known traps handled here: each generation has its own store prefix (a reused one makes gloo read stale
peer addresses); torch's group counter is reset before every ``init_process_group`` when no group exists
(a failed init leaves it incremented, and group names would differ between ranks); the ``sys.excepthook``
that every ``init_process_group`` wraps again is restored; the references to a failed group are dropped
(traceback frames cleared) before it is destroyed, so its sockets close and peers blocked on this rank
fail at once instead of after their timeout.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._checkpoint import load
from ._config import config_of
from ._errors import ElasticError, SyncError
from ._fork import install as release_connections_in_forked_children
from ._rendezvous import Rendezvous
from ._store import connect, format_address, parse_address
from ._sync import sync
from ._timeouts import as_timedelta
from ._tree import tensor_index

__all__ = ["World", "run"]

log = logging.getLogger("elastic")

#: How long a collective may wait and a peer may make no progress, when `timeout` is not given.
DEFAULT_TIMEOUT = timedelta(seconds=60)
#: How long a generation may take to form (torch's rendezvous join timeout), when not given.
DEFAULT_JOIN_TIMEOUT = timedelta(seconds=600)
#: Seconds between two polls of the store while looking for evidence of a peer's failure.
_POLL = 0.02
#: What gloo says when the other end of a pair closed its socket: that peer's process or group is gone.
_BROKEN_PAIR = ("connection closed by peer", "connection reset by peer", "broken pipe")


class _EndGeneration(BaseException):
    """Raised by `World.check` on every rank at the same call when the generation ends by agreement.

    A `BaseException`, so that ``except Exception`` in user code does not swallow it.
    """

    def __init__(self, leaving: bool) -> None:
        super().__init__("the generation ends at this check()")
        self.leaving = leaving


class World:
    """This rank's place in the current generation, and `check()`, the per-step collective."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        generation: int,
        group: Any,
        rdzv: Any,
        check_every: int,
        leave_requested: Callable[[], bool],
        timeout: timedelta,
    ) -> None:
        self.rank = rank
        self.size = size
        self.generation = generation
        self.group = group
        self._rdzv = rdzv
        self._check_every = check_every
        self._leave_requested = leave_requested
        self._timeout = timeout
        self._calls = 0
        self._store_warned = False

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size}, generation={self.generation})"

    def check(self) -> None:
        """Collective, once per step on every rank: end the generation here if someone joins or leaves.

        Every `check_every`-th call all-reduces one small flag ("a participant waits to join, or a member
        leaves"); when it is set, every rank leaves ``fn`` at this same call (the call raises an internal
        exception that `run` catches; do not catch ``BaseException`` around it). The other calls only
        record progress (a rank that makes none for `timeout` counts as hung).
        """
        self._rdzv.progress()
        self._calls += 1
        if self._calls % self._check_every:
            return
        leaving = self._leave_requested()
        flag = 2 if leaving else 0
        if not leaving:
            try:
                flag = 1 if self._rdzv.pending() else 0
            except ElasticError as exc:  # the store is gone: train on, the next regroup will say so
                if not self._store_warned:
                    self._store_warned = True
                    log.warning("check(): rendezvous store unreachable, training on (%s)", exc)
        else:
            self._rdzv.leave()
        t = torch.tensor([flag], dtype=torch.int32, device=_group_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self._rdzv.progress()
        if int(t.item()):
            raise _EndGeneration(leaving)


# --------------------------------------------------------------------------------------------------------
# The process group of a generation (the seam where gloo and NCCL differ)


def _uses_cuda(state: Any) -> bool:

    try:
        return any(t.is_cuda for t in tensor_index(state, "sync").values())
    except Exception:
        return False


def _group_device(group: Any) -> torch.device:
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _nccl_setup() -> torch.device:
    """CUDA device of this worker (``LOCAL_RANK``, else the current one) and NCCL's error handling.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up only): on an error or a watchdog timeout NCCL aborts
    its communicators without killing the process, so that `run` can regroup. Set it before the first
    NCCL group; a value already in the environment is kept.
    """
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _new_group(store: Any, membership: Any, backend: str, timeout: timedelta) -> Any:
    """A fresh default process group for `membership`, on its own prefix of `store`."""
    from torch.distributed.distributed_c10d import _world

    if dist.is_initialized():
        msg = (
            "elastic.run: a default process group already exists in this process; elastic.run creates "
            "one per generation itself: do not call init_process_group before run (or destroy it first)"
        )
        raise ElasticError(msg)
    # A failed init_process_group leaves torch's group counter incremented: reset it while no group
    # exists, so that every rank names its groups alike.
    if not _world.pg_map:
        _world.group_count = 0
    hook = sys.excepthook
    options: dict[str, Any] = {}
    group_timeout = timeout
    if backend == "nccl":
        options["device_id"] = _nccl_setup()
        # NCCL's watchdog must not fire before our own failure detection has ended the generation.
        group_timeout = timeout * 2
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(membership.prefix, store),
            rank=membership.rank,
            world_size=membership.size,
            timeout=group_timeout,
            **options,
        )
    except BaseException:
        if not _world.pg_map:
            _world.group_count = 0
        raise
    finally:
        sys.excepthook = hook  # init_process_group wraps it again every time
    return dist.group.WORLD


def _abort_group() -> None:
    """Abort and destroy the default group (gloo: closes its sockets; NCCL: ncclCommAbort first)."""
    _end_group(abort=True)


def _destroy_group() -> None:
    """The generation ended by agreement or fn returned: every rank is done with the group."""
    _end_group(abort=False)


def _end_group(*, abort: bool) -> None:
    if not dist.is_initialized():
        return
    group = dist.group.WORLD
    ref = None
    if group is not None:
        with contextlib.suppress(TypeError):
            ref = weakref.ref(group)
        if abort:
            with contextlib.suppress(Exception):
                group.abort()  # NCCL: unblocks kernels waiting for a dead peer; gloo: nothing to abort
    del group
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    # The group's sockets close when its last reference goes, which is now unless something (a DDP
    # module in a traceback's frame, a cycle) still holds it. A full gc.collect() holds the GIL for
    # half a second on a busy machine (long enough to miss heartbeats), so it runs only then.
    if ref is not None and ref() is not None:
        log.debug("the process group is still referenced after destroy; collecting garbage")
        gc.collect()


# --------------------------------------------------------------------------------------------------------
# Classifying failures


def _probe_seconds(timeout: timedelta, rdzv: Any) -> float:
    """How long a rank looks for evidence that a peer failed before calling an exception its own.

    It must cover a heartbeat's expiry after a hung peer's last progress (the rendezvous derives the
    expiry from `timeout`); a rank's own ``RuntimeError`` costs this long before it propagates.
    """
    seconds = timeout.total_seconds()
    expiry = float(getattr(rdzv, "expiry", seconds / 10))
    return min(seconds, max(2.0, 5 * expiry))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _communication_kind(exc: BaseException) -> bool:
    """Could `exc` come from a collective? (Necessary, never sufficient: see `_evidence`.)"""

    return any(isinstance(e, (RuntimeError, OSError, TimeoutError, SyncError)) for e in _chain(exc))


def _broken_pair(exc: BaseException) -> bool:
    return any(word in str(e).lower() for e in _chain(exc) for word in _BROKEN_PAIR)


class _Generation:
    """The store keys of one generation's announcements: who left it, and why."""

    def __init__(self, store: Any, membership: Any) -> None:
        self.store = dist.PrefixStore(f"{membership.prefix}/elastic-run", store)
        self.membership = membership

    def announce(self, why: str) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"ended/{self.membership.rank}", why)

    def announced(self) -> dict[int, str]:
        """The other ranks that announced why they left this generation (one store read each)."""
        found: dict[int, str] = {}
        for r in range(self.membership.size):
            if r == self.membership.rank:
                continue
            key = f"ended/{r}"
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    found[r] = self.store.get(key).decode()
        return found


def _evidence(exc: BaseException, rdzv: Any, gen: _Generation, probe: float) -> str | None:
    """Why the generation is broken by a peer (a sentence), or None when `exc` is this rank's own."""
    if isinstance(exc, _EndGeneration):
        return "ended by agreement"
    if not _communication_kind(exc):
        return None
    members = gen.membership.members
    if _broken_pair(exc):
        return "a peer closed its connection"
    deadline = time.monotonic() + probe
    while True:
        rdzv.progress()
        ended = gen.announced()
        if ended:
            return "; ".join(f"rank {r} left the generation ({why})" for r, why in sorted(ended.items()))
        try:
            alive = rdzv.alive()
        except ElasticError:
            alive = set(members)
        gone = [r for r, m in enumerate(members) if m not in alive and r != gen.membership.rank]
        if gone:
            return f"rank(s) {gone} stopped heartbeating (dead or hung)"
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL)


def _announce(rendezvous: Any) -> None:
    """Tell the rendezvous at once that this member regroups (the next round waits for it a little
    longer than for a silent one)."""
    announce = getattr(rendezvous, "announce", None)
    if announce is not None:
        with contextlib.suppress(Exception):
            announce()


def _strip(exc: BaseException) -> None:
    """Drop the frames' locals `exc` keeps alive (a DDP module holds the group: its sockets must close)."""
    for e in _chain(exc):
        with contextlib.suppress(Exception):
            traceback.clear_frames(e.__traceback__)


class _NcclWatch(threading.Thread):
    """NCCL only (untested here, no GPU): abort the group from the side when a peer is gone.

    A NCCL collective waiting for a dead or hung peer blocks in a CUDA kernel, where neither the gloo-style
    error of a closed socket nor a timeout of ours reaches it (NCCL's own watchdog fires after the group's
    timeout, which `_new_group` sets to twice ours so that this thread acts first). While a generation
    runs, this thread polls the rendezvous every 0.1 s and, as soon as a member's heartbeat stopped or a
    member announced the end of the generation, aborts the group (``ncclCommAbort`` on every
    communicator): the blocked collective then raises in the main thread, where `_evidence` finds the
    same evidence and `run` regroups.
    """

    PERIOD = 0.1

    def __init__(self, rdzv: Any, gen: _Generation, group: Any) -> None:
        super().__init__(daemon=True, name=f"elastic-nccl-watch-{gen.membership.generation}")
        self._rdzv = rdzv
        self._gen = gen
        self._group = group
        self._stop = threading.Event()

    def run(self) -> None:
        members = self._gen.membership.members
        me = self._gen.membership.rank
        while not self._stop.wait(self.PERIOD):
            try:
                alive = self._rdzv.alive()
                gone = [r for r, m in enumerate(members) if m not in alive and r != me]
                if gone or self._gen.announced():
                    log.warning(
                        "generation %d: aborting the NCCL group (a peer is gone)",
                        self._gen.membership.generation,
                    )
                    self._group.abort()
                    return
            except Exception as exc:  # the watch must never kill the worker
                log.debug("nccl watch: %s", exc)

    @staticmethod
    def stop(watch: _NcclWatch | None) -> None:
        if watch is not None:
            watch._stop.set()
            if watch.is_alive():
                watch.join(timeout=5)
            watch._group = None


# --------------------------------------------------------------------------------------------------------
# SIGTERM: a planned departure


class _Departure:
    """Installs a SIGTERM handler (main thread only) that asks this worker to leave at its next check."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _Departure:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.requested.is_set():
            log.info("SIGTERM: leaving at the next check()")
        self.requested.set()

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


# --------------------------------------------------------------------------------------------------------


def _check_args(fn: Any, min_workers: Any, max_workers: Any, check_every: Any, run_id: Any) -> None:
    if not callable(fn):
        msg = f"elastic.run(fn, state): fn must be callable as fn(state, world), got {fn!r}"
        raise TypeError(msg)
    if not isinstance(min_workers, int) or isinstance(min_workers, bool) or min_workers < 1:
        msg = f"elastic.run(min_workers=...) must be an int >= 1, got {min_workers!r}"
        raise ValueError(msg)
    if max_workers is not None and (
        not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < min_workers
    ):
        msg = (
            f"elastic.run(max_workers=...) must be None or an int >= min_workers={min_workers}, "
            f"got {max_workers!r}"
        )
        raise ValueError(msg)
    if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
        msg = f"elastic.run(check_every=...) must be an int >= 1, got {check_every!r}"
        raise ValueError(msg)
    if not isinstance(run_id, str) or not run_id:
        msg = f"elastic.run(run_id=...) must be a non-empty string, got {run_id!r}"
        raise ValueError(msg)


def _participant_id() -> str:
    slot = os.environ.get("ELASTIC_SLOT")
    where = f"slot{slot}-" if slot is not None else ""
    return f"{socket.gethostname()}-{where}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _start(state: Any, ckpt: Any, timeout: timedelta) -> tuple[int, Any]:
    """The generation's first collective: load or sync. (elected source, its tenure)"""
    if ckpt is not None:
        report = load(state, ckpt, timeout=timeout)
        return report.src, report.tenure

    sync_report = sync(state, timeout=timeout)
    return sync_report.src, sync_report.tenure


def run(
    fn: Callable[[Any, World], Any],
    state: Any,
    *,
    rdzv: str | None = None,
    run_id: str = "elastic",
    min_workers: int = 1,
    max_workers: int | None = None,
    ckpt: str | os.PathLike[str] | None = None,
    timeout: timedelta | float | None = None,
    join_timeout: timedelta | float | None = None,
    check_every: int = 1,
) -> Any:
    """Run ``fn(state, world)`` in generations that survive failures; call it in every worker process.

    Every worker is one participant of the rendezvous at `rdzv` (``"host:port"``, default
    ``$ELASTIC_RDZV``; served by ``elastic.spawn(..., restart="worker")`` or ``python -m elastic.store``).
    Each generation has `min_workers` to `max_workers` members, a fresh default process group (gloo; NCCL
    when the state holds CUDA tensors), then ``elastic.load(state, ckpt)`` when `ckpt` is given, else
    ``elastic.sync(state)``: the most tenured state wins, newcomers receive; then ``fn(state, world)``.

    - A communication failure caused by a peer that died, hung (no progress for `timeout`) or left ends
      the generation on every survivor; the next one forms with whoever is alive or waiting. At most the
      step in flight is lost. Build objects bound to the group (DDP, samplers' worlds) inside ``fn``.
    - ``world.check()``, called by every rank once per step, ends the generation at the same call on
      every rank when a worker waits to join or leaves (every `check_every`-th call exchanges the flag).
    - Any other exception from ``fn`` propagates out of `run` on its rank, after its group is aborted.
    - SIGTERM (a preemption notice) is a planned departure: the step finishes, the worker leaves at its
      next ``check()`` with the others, and `run` returns None there; the others lose no step. (The
      handler is installed only when `run` is called from the main thread, and restored on return.)
    - Fewer than `min_workers` alive: wait for joiners until `join_timeout` (default 600 s), then
      `ElasticError`. `timeout` (default 60 s) bounds every collective and the store's operations.

    Returns fn's value, or None after a planned departure, or at once when the run had already finished
    (fn returned in some generation) before this worker could join.
    """
    _check_args(fn, min_workers, max_workers, check_every, run_id)
    release_connections_in_forked_children()
    config_of(state, "elastic.run()")
    td = as_timedelta(timeout, "elastic.run") or DEFAULT_TIMEOUT
    join_td = as_timedelta(join_timeout, "elastic.run") or DEFAULT_JOIN_TIMEOUT

    host, port = parse_address(rdzv)
    store = connect(host, port, timeout=td)
    participant = _participant_id()
    rendezvous = Rendezvous(
        store,
        run_id,
        participant,
        min_workers=min_workers,
        max_workers=max_workers,
        join_timeout=join_td,
        timeout=td,
        address=format_address(host, port),
    )
    backend = "nccl" if _uses_cuda(state) else "gloo"
    probe = _probe_seconds(td, rendezvous)
    try:
        with _Departure() as departure:
            return _loop(fn, state, store, rendezvous, departure, backend, ckpt, td, probe, check_every)
    finally:
        rendezvous.close()


def _loop(
    fn: Callable[[Any, World], Any],
    state: Any,
    store: Any,
    rendezvous: Any,
    departure: _Departure,
    backend: str,
    ckpt: Any,
    td: timedelta,
    probe: float,
    check_every: int,
) -> Any:
    ended_at = time.monotonic()
    while True:
        rendezvous.progress()
        membership = rendezvous.join()
        if membership is None:
            log.info("run: the run is already finished; nothing to do")
            return None
        gen = _Generation(store, membership)
        try:
            group = _new_group(store, membership, backend, td)
        except Exception as exc:
            _strip(exc)
            gen.announce("process group failed to form")
            _abort_group()
            log.warning(
                "generation %d: the process group did not form (%s: %s); regrouping",
                membership.generation,
                type(exc).__name__,
                str(exc).strip().splitlines()[0][:160] if str(exc).strip() else "",
            )
            ended_at = time.monotonic()
            continue
        world = World(
            rank=membership.rank,
            size=membership.size,
            generation=membership.generation,
            group=group,
            rdzv=rendezvous,
            check_every=check_every,
            leave_requested=departure.requested.is_set,
            timeout=td,
        )
        watch = _NcclWatch(rendezvous, gen, group) if backend == "nccl" else None
        del group
        try:
            if watch is not None:
                watch.start()
            rendezvous.progress()
            src, tenure = _start(state, ckpt, td)
            rendezvous.progress()
            log.info(
                "generation %d: %d workers, rank %d, source rank %d (tenure %r), regrouped in %.2f s",
                membership.generation,
                membership.size,
                membership.rank,
                src,
                tenure,
                time.monotonic() - ended_at,
            )
            result = fn(state, world)
        except _EndGeneration as end:
            ended_at = time.monotonic()
            _NcclWatch.stop(watch)
            if not end.leaving:
                _announce(rendezvous)
            _strip(end)
            world.group = None
            _destroy_group()
            if end.leaving:
                log.info("generation %d: left as asked (SIGTERM)", membership.generation)
                return None
            log.info("generation %d: ends at this check(): a worker joins or leaves", membership.generation)
            continue
        except BaseException as exc:
            ended_at = time.monotonic()
            _NcclWatch.stop(watch)
            _strip(exc)
            world.group = None
            why = _evidence(exc, rendezvous, gen, probe) if isinstance(exc, Exception) else None
            if why is None:
                gen.announce(f"raised {type(exc).__name__}")
                _abort_group()
                raise
            leaving = departure.requested.is_set()
            if leaving:
                rendezvous.leave()  # SIGTERM came first: the others need not wait for this member
            else:
                _announce(rendezvous)
            gen.announce("saw the group fail")
            text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            del exc
            _abort_group()
            log.warning(
                "generation %d: communication failed (%s: %s); regrouping", membership.generation, why, text
            )
            if leaving:
                log.info("generation %d: SIGTERM received; not rejoining", membership.generation)
                return None
            continue
        _NcclWatch.stop(watch)
        rendezvous.finish()
        world.group = None
        _destroy_group()
        return result
