"""`elastic.run`: survivors keep their state in memory and re-form the group, losing at most one step.

Every worker process is one participant of a rendezvous (`._rendezvous`) over a TCPStore that outlives
the workers. `run` loops over *generations*; each one is

1. a membership from the rendezvous (generation number, rank, size, a store prefix never used before),
2. the members' link check (`elastic.recovery.links`): a pair that cannot connect means no group is
   attempted; the next round keeps the largest set with no such pair, and a member left out waits outside
   until its links heal (`_Loop.rejoin`),
3. a fresh default process group on that prefix (gloo, its formation bounded; NCCL when the state holds
   CUDA tensors),
4. `elastic.load(state, ckpt)` when `ckpt` is given, else `elastic.sync(state)` (the most tenured wins),
5. ``fn(state, world)``.

A generation ends in one of four ways:

- ``fn`` returns: the run is finished (`Rendezvous.finish`); `run` returns the value.
- `World.check` sees, in its flag exchange, that someone waits to join or leaves (SIGTERM): every rank
  leaves at the same call; the leaver's `run` returns ``None``, the others form the next generation.
- A communication failure caused by a peer (it died, hung past `timeout`, aborted its group): the group
  is aborted and destroyed and the next generation forms.
- Any other exception: this rank announces it, aborts its group (so the peers notice in milliseconds)
  and the exception propagates out of `run`.

Classifying a failure. Gloo reports a dead or hung peer as a plain ``RuntimeError``, and user code raises
``RuntimeError`` too, so the type alone decides nothing. A rank whose collective failed records where it
was (`where_of`: which library call and phase, or a collective of ``fn``'s own) under the generation's
store prefix and aborts its group at once, so that every peer blocked on it fails too and records as well.
`_judge` then accounts for every member: one that recorded, one in `World.busy`, one that announced it left
(its own exception), one whose process exited (same host) or whose heartbeat stays stale with no record.
A member gone or departed is a peer's failure: regroup. Every member present, in different places (rank 0
in ``save``, the others in DDP's all-reduce) is the script's bug: every rank raises the same
`ElasticError`. Every member present in one place is nobody's failure: the exception propagates. The
first verdict written to the store is everyone's. Generations that keep failing before a step completes
at one tenure end after `STALL_LIMIT` with their history (`_Stalls`).

Known traps handled here: each generation has its own store prefix (a reused one makes gloo read stale
peer addresses); torch's group counter is reset before every ``init_process_group`` when no group exists
(a failed init leaves it incremented, and group names would differ between ranks); the ``sys.excepthook``
that every ``init_process_group`` wraps again is restored; the references to a failed group are dropped
(traceback frames cleared) before it is destroyed, so its sockets close and peers blocked on this rank
fail at once instead of after their timeout.
"""

from __future__ import annotations

import contextlib
import functools
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

import attrs
import torch
import torch.distributed as dist

from elastic._util.errors import ElasticError, SyncError
from elastic._util.sockets import Sockets
from elastic._util.timeouts import as_timedelta
from elastic._util.words import ranks_str
from elastic.checkpoint.saveload import load
from elastic.recovery.builder import Built, MeshPlan, warm_up
from elastic.recovery.fork import install as release_connections_in_forked_children
from elastic.recovery.links import Cut, Links, probe_seconds
from elastic.recovery.partition import largest_reachable
from elastic.recovery.rendezvous import FINISHED, RECONNECT, Rendezvous
from elastic.recovery.store import connect, connect_first, format_address, parse_addresses
from elastic.replication.sync import sync, tenure
from elastic.state.config import config_of, is_elastic_state
from elastic.state.tree import tensor_index

__all__ = ["World", "run"]

log = logging.getLogger("elastic")

#: How long a collective may wait and a peer may make no progress, when `timeout` is not given.
DEFAULT_TIMEOUT = timedelta(seconds=60)
#: How long a generation may take to form (torch's rendezvous join timeout), when not given.
DEFAULT_JOIN_TIMEOUT = timedelta(seconds=600)
#: Seconds between two polls of the store while looking for evidence of a peer's failure.
_POLL = 0.02
#: Generations in a row that may fail before a step completes, at one tenure, before `run` gives up.
STALL_LIMIT = 4


class _EndGeneration(BaseException):
    """Raised by `World.check` on every rank at the same call when the generation ends by agreement.

    A `BaseException`, so that ``except Exception`` in user code does not swallow it.
    """

    def __init__(self, leaving: bool) -> None:
        super().__init__("the generation ends at this check()")
        self.leaving = leaving


class World:
    """This rank's place in the current generation of `elastic.run`, and `check()`, the per-step collective.

    `run` builds one for every generation and passes it to ``fn(state, world)``; users do not build it.

    Attributes:
        rank: this worker's rank in the generation (0 .. size-1). Ranks follow the workers' stable order
            (their ``elastic.spawn`` slot or launcher rank), not the order in which they joined.
        size: how many workers the generation has.
        generation: the generation's number, the same on every member; increasing, 0 first.
        group: the generation's process group, also torch's default group. Build objects bound to it
            (``DistributedDataParallel``, samplers' worlds) inside ``fn``: each generation has its own.
        mesh: the generation's ``DeviceMesh`` for sharded states; None for replicated states.
    """

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
        note: Callable[[str | None], None] | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.generation = generation
        self.group = group
        self.mesh: Any = None
        self._rdzv = rdzv
        self._check_every = check_every
        self._leave_requested = leave_requested
        self._timeout = timeout
        self._note = note
        self._calls = 0
        self._store_warned = False
        #: (k, take): a builder's snapshot, taken at every k-th check (`elastic.replication.snapshot`)
        self._snapshot: tuple[int, Callable[[], None]] | None = None
        self._busy: list[str] = []  # the open `busy` blocks, innermost last

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size}, generation={self.generation})"

    def progress(self) -> None:
        """Record progress now: this worker counts as alive for another `timeout` (local, no store).

        `check` and elastic's own collectives call it; call it in a long stretch of local work between
        two checks, or use `busy`.
        """
        self._rdzv.progress()

    @contextlib.contextmanager
    def busy(self, what: str = "long local work") -> Iterator[None]:
        """Long local work (a first ``torch.compile``, a long evaluation) counts as progress while it runs.

        Inside the block this worker heartbeats as if it made progress all along, so the others do not take
        it for hung, however long the block takes; a real hang inside it is then not detected. `timeout`
        still bounds every collective: a rank that waits inside a collective for a peer still in its
        ``busy`` block fails after `timeout` (and `run` names both places). Enter the block on every rank
        for work they all do (compiling the same graph), or raise `timeout` above the longest wait.

        Args:
            what: a few words for error messages and logs ("compile", "eval").

        Returns:
            A context manager.
        """
        self._busy.append(what)
        if self._note is not None:
            self._note(f"world.busy({what!r})")
        try:
            with self._rdzv.hold():
                yield
        finally:
            self._busy.pop()
            if self._note is not None:  # an outer block still runs: it is where this rank is
                self._note(f"world.busy({self._busy[-1]!r})" if self._busy else None)

    def check(self) -> None:
        """Collective, once per step on every rank: end the generation here if someone joins or leaves.

        Every `check_every`-th call all-reduces one small flag ("a participant waits to join, or a member
        leaves"); when it is set, every rank leaves ``fn`` at this same call (the call raises an internal
        exception that `run` catches; do not catch ``BaseException`` around it). The other calls only
        record progress (a rank that makes none for `timeout` counts as hung). With ``run(...,
        snapshot_every=k)``, every k-th call first copies this rank's pieces to CPU memory and sends them
        to a peer in the background (see `run`).

        Raises:
            RuntimeError: the flag's all-reduce failed (a peer died or hung): `run` catches it and regroups.
        """
        self._rdzv.progress()
        self._calls += 1
        if self._snapshot is not None and self._calls % self._snapshot[0] == 0:
            self._snapshot[1]()
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
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:
            exc._elastic_where = "world.check()"  # type: ignore[attr-defined]
            raise
        self._rdzv.progress()
        if int(t.item()):
            raise _EndGeneration(leaving)


def clear_grads(state: Any) -> int:
    """Set the ``.grad`` of every parameter of `state`'s modules and optimizers to None (a step that a
    failure interrupted leaves nothing to accumulate onto). Walks the fields, nested states and
    containers. Returns how many gradients were cleared."""
    cleared = 0
    seen: set[int] = set()

    def visit(value: Any) -> None:
        nonlocal cleared
        if id(value) in seen:
            return
        seen.add(id(value))
        params: Iterator[Any] = iter(())
        if isinstance(value, torch.nn.Module):
            params = value.parameters()
        elif isinstance(value, torch.optim.Optimizer):
            params = (p for g in value.param_groups for p in g["params"])
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif attrs.has(type(value)):
            for f in attrs.fields(type(value)):
                visit(getattr(value, f.name, None))
        for p in params:
            if isinstance(p, torch.Tensor) and p.grad is not None:
                p.grad = None
                cleared += 1

    visit(state)
    return cleared


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


#: Why `run` refuses a process that already has a default group (it makes one per generation).
_GROUP_EXISTS = (
    "elastic.run: a default process group already exists in this process; elastic.run creates one per "
    "generation itself: do not call init_process_group before run (or destroy it first)"
)


def _init_timeout(timeout: timedelta) -> timedelta:
    """The timeout gloo's group formation gets: gloo retries a connect that times out, for 5 times the
    timeout it is given in all (measured here towards an unreachable peer: 15 s with 3 s, 2.5 s with
    0.5 s), so it gets a fifth of `timeout`, at least 1 s (it also bounds the wait for the peers'
    addresses in the store, which the members' link check has aligned), never more than `timeout`."""
    return min(timeout, max(timedelta(seconds=1), timeout / 5))


def _new_group(
    store: Any,
    membership: Any,
    backend: str,
    timeout: timedelta,
    hold: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Any:
    """A fresh default process group for `membership`, on its own prefix of `store`.

    Gloo's formation is bounded by about `timeout` (`_init_timeout`); its collectives then get `timeout`.
    `hold()` is entered around the formation (the rendezvous's: this worker heartbeats meanwhile).
    """
    from torch.distributed.distributed_c10d import _world

    if dist.is_initialized():
        raise ElasticError(_GROUP_EXISTS)
    # A failed init_process_group leaves torch's group counter incremented: reset it while no group
    # exists, so that every rank names its groups alike.
    if not _world.pg_map:
        _world.group_count = 0
    hook = sys.excepthook
    options: dict[str, Any] = {}
    group_timeout = _init_timeout(timeout) if backend == "gloo" else timeout
    if backend == "nccl":
        options["device_id"] = _nccl_setup()
        # NCCL's watchdog must not fire before our own failure detection has ended the generation.
        group_timeout = timeout * 2
    try:
        with hold():
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(membership.prefix, store),
                rank=membership.rank,
                world_size=membership.size,
                timeout=group_timeout,
                **options,
            )
        if group_timeout != timeout and backend == "gloo":
            dist.group.WORLD.set_timeout(timeout)  # type: ignore[union-attr]
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
    """Could `exc` come from a collective? (Necessary, never sufficient: see `_judge`.)"""

    return any(isinstance(e, (RuntimeError, OSError, TimeoutError, SyncError)) for e in _chain(exc))


#: Where a rank failing in a collective that is not one of the library's was: one of ``fn``'s own.
IN_FN = "a collective of fn (e.g. DDP's all-reduce)"
#: Where a member was that had no failure of its own when the others failed.
RUNNING = "fn, in no collective (no failure of its own)"


def where_of(exc: BaseException) -> str:
    """Which operation this rank was in when `exc` ended its generation, in words for error messages."""
    for e in _chain(exc):
        where = getattr(e, "_elastic_where", None)
        if where:
            return str(where)
        if isinstance(e, SyncError) and getattr(e, "op", None):
            phase = f" (phase '{e.phase}')" if e.phase else ""
            return f"{e.op}(){phase}"
    return IN_FN


class _Generation:
    """The store keys of one generation's failure handling, under its own prefix.

    - ``ended/<rank>``: why a rank left the generation (announced after it decided);
    - ``failed/<rank>``: where a rank was when a collective failed on it (`where_of`);
    - ``busy/<rank>``: set while a rank is in `World.busy` (a rank with no failure of its own);
    - ``verdict``: the first verdict written; every rank adopts it (`_judge`).
    """

    def __init__(self, store: Any, membership: Any) -> None:
        #: the store, or a callable giving the rendezvous' client now (renewed after a store restart)
        self._client = store if callable(store) else (lambda: store)
        self._base: Any = None
        self._prefixed: Any = None
        self.membership = membership

    @property
    def store(self) -> Any:
        base = self._client()
        if base is not self._base:
            self._base, self._prefixed = base, dist.PrefixStore(f"{self.membership.prefix}/elastic-run", base)
        return self._prefixed

    def _set(self, key: str, value: str) -> None:
        with contextlib.suppress(Exception):
            self.store.set(key, value)

    def _others(self, kind: str) -> dict[int, str]:
        found: dict[int, str] = {}
        for r in range(self.membership.size):
            if r == self.membership.rank:
                continue
            key = f"{kind}/{r}"
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    value = self.store.get(key).decode()
                    if value:
                        found[r] = value
        return found

    def announce(self, why: str) -> None:
        self._set(f"ended/{self.membership.rank}", why)

    def announced(self) -> dict[int, str]:
        """The other ranks that announced why they left this generation (one store read each)."""
        return self._others("ended")

    def record(self, where: str) -> None:
        self._set(f"failed/{self.membership.rank}", where)

    def records(self) -> dict[int, str]:
        return self._others("failed")

    def note(self, where: str | None) -> None:
        """This rank is in `World.busy` (`where`), or no longer (None)."""
        self._set(f"busy/{self.membership.rank}", where or "")

    def notes(self) -> dict[int, str]:
        return self._others("busy")

    def verdict(self, mine: str | None) -> str | None:
        """The generation's verdict: the first one written (`mine` when it is the first; None: read only)."""
        try:
            if mine is None:
                if not self.store.check(["verdict"]):
                    return None
                return self.store.get("verdict").decode() or None
            return self.store.compare_set("verdict", "", mine).decode() or mine
        except Exception:
            return mine


#: Verdicts of `_judge`: "regroup:<why>" (a peer failed), "mismatch:<message>" (ranks were in different
#: operations: the user's bug), "own" (no peer's failure: each rank's exception propagates).
REGROUP, MISMATCH, OWN = "regroup:", "mismatch:", "own"


def _mismatch_message(places: dict[int, str], timeout: timedelta) -> str:
    by_place: dict[str, list[int]] = {}
    for r, where in sorted(places.items()):
        by_place.setdefault(where, []).append(r)
    parts = "; ".join(f"{ranks_str(rs)} in {where}" for where, rs in by_place.items())
    return (
        f"elastic.run: the ranks of the generation were in different operations when it failed ({parts}), "
        f"every heartbeat fresh and nobody gone: this is not a peer's failure but the script's. Every rank "
        f"must make the same collective calls in the same order: call elastic.save/sync/load/verify and "
        f"evaluations with collectives on every rank, not on rank 0 only (they elect their writer "
        f"themselves); a rank that waits for another longer than timeout={timeout.total_seconds():g} s "
        f"fails (raise timeout, or use world.busy() for long local work on every rank)"
    )


def _judge(
    exc: BaseException,
    rdzv: Any,
    gen: _Generation,
    probe: float,
    timeout: timedelta,
    links: Callable[[set[int]], str | None] | None = None,
) -> str:
    """What ended the generation on this rank, agreed by every rank that asks (a `REGROUP`, `MISMATCH` or
    `OWN` verdict).

    This rank records where it was and has aborted its group already (so that every peer blocked on it
    fails at once and records too). A member is accounted for when it recorded a failure, is in
    `World.busy`, announced that it left (its own exception), or is gone: its process exited (same host,
    known at once) or its heartbeat stays stale past its expiry with no record. A gone or departed member
    is a peer's failure; with every member present and accounted for, different places are a mismatch
    (the script's bug), one place for all is nobody's failure. The first verdict written wins.

    Every member present and every heartbeat fresh is also what a link gone silent between two members
    looks like (their collective waits for `timeout`, and so does everyone's): before it says `MISMATCH`
    or `OWN`, `links(ranks)` compares every member's connections with those of `ranks` (the members that
    failed too, `elastic.recovery.links`); a pair that cannot connect is a peer's failure, `REGROUP`.
    """
    members = gen.membership.members
    me = gen.membership.rank
    began = time.monotonic()
    deadline = began + probe
    settle = began + float(getattr(rdzv, "expiry", 0.5))
    places = {me: where_of(exc)}
    while True:
        rdzv.progress()
        agreed = gen.verdict(None)
        if agreed is not None:
            return agreed
        ended = gen.announced()
        if ended:
            why = "; ".join(f"rank {r} left the generation ({w})" for r, w in sorted(ended.items()))
            return gen.verdict(REGROUP + why) or REGROUP + why
        exited: set[str] = getattr(rdzv, "exited", set)()
        places.update(gen.records())
        gone_now = [r for r, m in enumerate(members) if m in exited and r not in places]
        if gone_now:
            why = f"rank(s) {gone_now} exited"
            return gen.verdict(REGROUP + why) or REGROUP + why
        try:
            alive = rdzv.alive()
        except ElasticError:
            alive = set(members)
        now = time.monotonic()
        stale = [r for r, m in enumerate(members) if r not in places and m not in alive]
        if stale and now >= settle:
            why = f"rank(s) {stale} stopped heartbeating (dead or hung)"
            return gen.verdict(REGROUP + why) or REGROUP + why
        busy = gen.notes()
        unaccounted = [r for r in range(len(members)) if r not in places and r not in busy]
        if not unaccounted or now >= deadline:
            if stale:
                time.sleep(_POLL)
                continue  # wait for the settle: a stale member without a record is gone, not elsewhere
            cut = links(set(places)) if links is not None else None
            if cut:
                return gen.verdict(REGROUP + cut) or REGROUP + cut
            seen = dict(places)
            seen.update({r: busy.get(r, RUNNING) for r in unaccounted + list(busy) if r not in places})
            mine = MISMATCH + _mismatch_message(seen, timeout) if len(set(seen.values())) > 1 else OWN
            return gen.verdict(mine) or mine
        time.sleep(_POLL)


#: The tenure a generation started at when it failed before its load or sync ended (no step completed).
NOT_STARTED: Any = object()


class _Stalls:
    """Generations that fail before a step completes at the same tenure, in a row: after `limit` of them
    `run` stops with their history instead of regrouping forever."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.history: list[str] = []
        self._tenure: Any = None

    def failed(self, generation: int, started_at: Any, now: Any, why: str) -> ElasticError | None:
        """Count a failed generation (its tenure when it started, `NOT_STARTED` when it failed in its
        load or sync, and now); the error once past `limit`."""
        try:
            stalled = started_at is NOT_STARTED or bool(started_at == now)
            again = bool(self._tenure == now)
        except Exception:  # tenures that do not compare: count nothing
            stalled = again = False
        if not stalled:
            self.history = []
            return None
        if not again:
            self.history = []
        self._tenure = now
        self.history.append(f"generation {generation}: {why}")
        if len(self.history) < self.limit:
            return None
        lines = "\n  ".join(self.history)
        msg = (
            f"elastic.run: {len(self.history)} generations in a row failed before a step completed, all at "
            f"tenure {now!r}; stopping instead of regrouping forever:\n  {lines}\nA worker that dies or "
            f"hangs at the same point every time (out of memory, a deterministic crash, a collective "
            f"only some ranks call) causes this; fix it and start again (the state is in memory on the "
            f"survivors only until they exit: pass ckpt= to keep it)"
        )
        return ElasticError(msg)

    def succeeded(self) -> None:
        """A step completed (the tenure moved) or the generation ended by agreement."""
        self.history = []


def _announce(rendezvous: Any) -> None:
    """Tell the rendezvous at once that this member regroups (the next round waits for it a little
    longer than for a silent one)."""
    announce = getattr(rendezvous, "announce", None)
    if announce is not None:
        with contextlib.suppress(Exception):
            announce()


#: The note that keeps a traceback's text once `_strip` dropped its frames.
RAISED_AT = "elastic.run: raised at (the frames were released so that the process group's sockets close):\n"


def _strip(exc: BaseException) -> None:
    """Drop what `exc`'s tracebacks keep alive (a module holds the group: its sockets must close).

    Clearing the frames' locals is not enough from Python 3.11 on: a frame keeps its function, and a
    closure its cells (torch's ``Module._call_impl`` runs every module with hooks, FSDP2's included,
    through a closure over the module). So the tracebacks themselves go; their text stays as a note
    (`RAISED_AT`), printed with the exception if it propagates."""
    for e in _chain(exc):
        tb = e.__traceback__
        if tb is None:
            continue
        if hasattr(e, "add_note"):  # Python >= 3.11 (where frames keep their functions)
            e.add_note(RAISED_AT + "".join(traceback.format_tb(tb)).rstrip())
            e.__traceback__ = None
        with contextlib.suppress(Exception):
            traceback.clear_frames(tb)
        del tb


class _Watch(threading.Thread):
    """While a generation runs, end its blocked collectives as soon as a peer is judged gone.

    A collective waiting for a dead, cut-off or hung peer otherwise waits for the group's timeout: gloo
    blocks in its pairs (and its ``abort()`` does not unblock them, pytorch#130345), NCCL in a CUDA
    kernel. Every `PERIOD` this thread asks the rendezvous which members' heartbeats have not changed for
    `stale_after` (twice the rendezvous's expiry, at least 1 s, once ``fn`` runs, or the member's own
    `Rendezvous.limit` when longer: a lossy network's retransmissions hold a beat; longer while the
    generation starts: a live peer's heartbeat thread can miss half a second while its main thread holds
    the GIL; `expired`: no store read, the heartbeat thread's
    last reading) and, at the first such member, writes the generation's verdict (regroup: every rank's
    `_judge` adopts it, so that a peer judged gone wrongly costs one regroup, never an error) and then:

    - gloo: shuts down the TCP connections this process opened for the generation (`Sockets`: every
      group of it, the mesh's too; the store's connections and listening sockets stay). The blocked
      collective raises ``Connection closed by peer`` at once, and so do the collectives of the peers at
      the other end, which regroup without waiting for their own watch;
    - NCCL (untested here, no GPU): aborts the group (``ncclCommAbort``); it also acts on a member's
      failure record or announcement, since an aborted communicator tells its peers nothing.

    The blocked call then raises in the main thread, where `_judge` finds the same evidence (the expired
    heartbeat) and `run` regroups. A live peer that makes progress keeps heartbeating, so `timeout` stays
    the bound for one that is alive but silent.
    """

    PERIOD = 0.1

    def __init__(self, rdzv: Any, gen: _Generation, group: Any, sockets: Sockets | None) -> None:
        super().__init__(daemon=True, name=f"elastic-watch-{gen.membership.generation}")
        self._rdzv = rdzv
        self._gen = gen
        self._group = group
        self._sockets = sockets
        self._halt = threading.Event()
        #: set once ``fn`` runs (the generation started)
        self.training = threading.Event()

    def run(self) -> None:
        members = list(self._gen.membership.members)
        while not self._halt.wait(self.PERIOD):
            try:
                why = self._evidence(members)
                if why is None:
                    continue
                if self._halt.is_set():
                    return
                self._end(why)
                return
            except Exception as exc:  # the watch must never kill the worker
                log.debug("watch: %s", exc)

    @property
    def stale_after(self) -> float:
        """How long a member's heartbeat may stand still: twice the expiry, at least 1 s, once ``fn`` runs;
        the rendezvous's `grace` (5 expiries) while the generation starts (a build, a reshard, a sync: the
        phases that hold the GIL longest, in every member at once)."""
        expiry = float(getattr(self._rdzv, "expiry", 0.5))
        if not self.training.is_set():
            return max(float(getattr(self._rdzv, "grace", 5 * expiry)), 1.0)
        return max(2 * expiry, 1.0)

    def _evidence(self, members: list[str]) -> str | None:
        gone = self._rdzv.expired(self.stale_after)
        if gone:
            ranks = sorted(members.index(p) for p in gone if p in members)
            return f"rank(s) {ranks} stopped heartbeating (dead or hung)"  # `_judge`'s words
        if self._sockets is None and (self._gen.announced() or self._gen.records()):
            return "a member's collective failed"
        return None

    def _end(self, why: str) -> None:
        generation = self._gen.membership.generation
        self._gen.verdict(REGROUP + why)  # before any collective fails: every rank regroups
        if self._sockets is None:
            log.warning("generation %d: aborting the NCCL group (%s)", generation, why)
            self._group.abort()
            return
        n = self._sockets.shutdown()
        log.warning(
            "generation %d: %s; ending its collectives (%d connection(s) shut down)", generation, why, n
        )

    @staticmethod
    def stop(watch: _Watch | None) -> None:
        if watch is not None:
            watch._halt.set()
            if watch.is_alive() and watch is not threading.current_thread():
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


def _check_count(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        msg = f"elastic.run({name}=...) must be an int >= {low}, got {value!r}"
        raise ValueError(msg)


def _check_args(
    fn: Any, min_workers: Any, max_workers: Any, first_workers: Any, check_every: Any, run_id: Any
) -> None:
    if not callable(fn):
        msg = f"elastic.run(fn, state): fn must be callable as fn(state, world), got {fn!r}"
        raise TypeError(msg)
    _check_count("min_workers", min_workers, 1)
    if max_workers is not None:
        _check_count("max_workers", max_workers, min_workers)
    if first_workers is not None:
        _check_count("first_workers", first_workers, min_workers)
        if max_workers is not None and first_workers > max_workers:
            msg = f"elastic.run(first_workers={first_workers}) must not exceed max_workers={max_workers}"
            raise ValueError(msg)
    _check_count("check_every", check_every, 1)
    if not isinstance(run_id, str) or not run_id:
        msg = f"elastic.run(run_id=...) must be a non-empty string, got {run_id!r}"
        raise ValueError(msg)


def _stable_order() -> int | None:
    """This worker's stable place among the run's workers: its `spawn` slot, else its launcher's rank."""
    for name in ("ELASTIC_SLOT", "RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _participant_id() -> str:
    """``<order>.<host>-[slot<k>-]<pid>-<random>``: the order (`_stable_order`, ``x`` when none) ranks the
    workers of a generation (`elastic.recovery.rendezvous.ranked`)."""
    order = _stable_order()
    slot = os.environ.get("ELASTIC_SLOT")
    where = f"slot{slot}-" if slot is not None else ""
    head = "x" if order is None else str(order)
    return f"{head}.{socket.gethostname()}-{where}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _start(state: Any, ckpt: Any, timeout: timedelta) -> tuple[int, Any]:
    """The generation's first collective: load or sync. (elected source, its tenure)"""
    if ckpt is not None:
        report = load(state, ckpt, timeout=timeout)
        return report.src, report.tenure

    sync_report = sync(state, timeout=timeout)
    return sync_report.src, sync_report.tenure


def _backend(state: Any, built: Built | None) -> str:
    if built is not None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if _uses_cuda(state) else "gloo"


def _tenure_now(state: Any) -> Any:
    try:
        return tenure(state)
    except Exception:
        return None


def run(
    fn: Callable[[Any, World], Any],
    state: Any,
    *,
    rdzv: str | None = None,
    run_id: str = "elastic",
    min_workers: int = 1,
    max_workers: int | None = None,
    first_workers: int | None = None,
    ckpt: str | os.PathLike[str] | None = None,
    timeout: timedelta | float | None = None,
    join_timeout: timedelta | float | None = None,
    check_every: int = 1,
    mesh: Callable[[int], tuple[int, ...]] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
    snapshot_every: int | None = None,
) -> Any:
    """Run ``fn(state, world)`` in generations that survive failures; call it in every worker process.

    Every worker is one participant of the rendezvous at `rdzv` (``"host:port"``, default
    ``$ELASTIC_RDZV``; served by ``elastic.spawn(..., restart="worker")`` or ``python -m elastic.store``).
    Each generation has `min_workers` to `max_workers` members, a fresh default process group (gloo; NCCL
    when the state holds CUDA tensors), then ``elastic.load(state, ckpt)`` when `ckpt` is given, else
    ``elastic.sync(state)``: the most tenured state wins, newcomers receive; the gradients of the state's
    modules and optimizers are cleared (None) on every member; then ``fn(state, world)``.

    - A communication failure caused by a peer that died, hung (no progress for `timeout`) or left ends
      the generation on every survivor; the next one forms with whoever is alive or waiting. At most the
      step in flight is lost. Build objects bound to the group (DDP, samplers' worlds) inside ``fn``.
    - A failure with every member alive and present, the ranks in different operations (rank 0 in
      ``save``, the others in DDP's all-reduce) is the script's bug: every rank raises `ElasticError`
      saying which rank was where. Generations that keep failing before a step completes, at one tenure,
      end after a few (`STALL_LIMIT`) in an `ElasticError` with their history.
    - ``world.check()``, called by every rank once per step, ends the generation at the same call on
      every rank when a worker waits to join or leaves (every `check_every`-th call exchanges the flag).
    - Any other exception from ``fn`` propagates out of `run` on its rank, after its group is aborted.
      Its traceback's frames are released first (they may hold the group, whose sockets must close for the
      peers to notice); the traceback's text is kept as a note on the exception (Python 3.11+).
    - SIGTERM (a preemption notice) is a planned departure: the step finishes, the worker leaves at its
      next ``check()`` with the others, and `run` returns None there; the others lose no step. (The
      handler is installed only when `run` is called from the main thread, and restored on return.)
    - Two workers that cannot connect to each other while both reach the store (an asymmetric partition):
      the largest set of workers that all reach each other goes on (found by a link check before every
      group forms, or after a collective timed out with everyone present); a worker left out waits and
      rejoins when its links heal, or raises `ElasticError` naming the pair after `join_timeout`.
    - Fewer than `min_workers` alive: wait for joiners until `join_timeout` (default 600 s), then
      `ElasticError`. `timeout` (default 60 s) bounds every collective and the store's operations, and is
      how long a worker may make no progress (``check()``, a collective of elastic's) before it counts as
      hung: wrap long local work in ``with world.busy():``.
    - Ranks follow the workers' stable order (`spawn` slot, else launcher rank), so tenure ties go alike
      in two runs started alike.
    - Sharded states: pass a *builder* instead of a state, ``run(fn, build, mesh=...)``. Every generation
      gets ``world.mesh`` (a ``DeviceMesh`` of shape ``mesh(n)`` for its `n` workers; workers beyond the
      shape's product wait as spares and are admitted first at the next change). When the mesh differs
      from the last one, ``build(world)`` makes the state on it (meta device, ``fully_shard``,
      ``to_empty``; it must not communicate: when the mesh stays, only newcomers build, and the survivors
      keep their state's objects, rebound to the new groups), and the state is filled in memory from
      the previous generation's pieces (the survivors', resharded onto the new mesh, every byte moved at
      most once, no disk), else from the newest snapshot held whole (``snapshot_every``), else from
      `ckpt`, else synced (a first generation); when nothing holds a whole version and there is no
      `ckpt`, every rank raises the `SyncError` naming what is missing. A generation that fails while
      filling keeps the pieces and snapshots for the next one.

    Args:
        fn: ``fn(state, world)``, called once per generation; its value is returned.
        state: an ``@elastic_state`` instance, kept in memory across generations; or a builder,
            ``build(world) -> state``, for a sharded state built on ``world.mesh`` (kept while it stays).
        rdzv: the rendezvous store's ``"host:port"`` (default ``$ELASTIC_RDZV``); a comma-separated
            list names standbys, tried in order (docs/cluster.md says what a standby guarantees).
        run_id: names the run in the store (several runs may share one store).
        min_workers: the fewest members a generation may have.
        max_workers: the most members a generation may have (None: no limit).
        first_workers: the first generation forms only with this many workers (torchrun's
            ``--nnodes=MIN:MAX`` waits for MAX only at its last call; this waits for all of them, within
            `join_timeout`); later generations need `min_workers`. None: `min_workers`.
        ckpt: a checkpoint root (path or fsspec URL): each generation starts with ``load(state, ckpt)``.
        timeout: bound of every collective and of a worker's silence (seconds or timedelta).
        join_timeout: how long a generation may take to form.
        check_every: every how many ``world.check()`` calls the flag is exchanged.
        mesh: with a builder, ``mesh(n) -> shape``: the mesh for `n` live workers (product at most `n`;
            default ``(n,)``).
        mesh_dim_names: the mesh's dimension names (default ``("shard",)`` for 1-D, ``("replicate",
            "shard")`` for 2-D; required beyond).
        snapshot_every: with a builder, every how many ``world.check()`` calls (counted per generation)
            each rank copies its pieces to CPU memory and sends a copy to one peer outside its replica set
            (a ring over shard positions), in a background thread on a gloo group of its own: only the
            device-to-host copy blocks the step. A worker lost from a mesh without replicas then costs at
            most `snapshot_every` steps: the survivors' snapshots and their copies of the lost worker's
            pieces form the state at the newest snapshot held whole, resharded with no disk read. Each
            rank keeps at most two snapshots (the newest complete one and the one in flight), each its
            own pieces plus one peer's copy: about twice its share of the state's tensors in CPU memory
            at rest, four times while one is in flight. None (default): no snapshots. Replicated states
            (passed as a state) take none: every rank already holds all of it.

    Returns:
        fn's value; None after a planned departure, or at once when the run had already finished (fn
        returned in some generation) before this worker could join.

    Raises:
        ElasticError: no generation formed within `join_timeout`; this worker could not connect to a
            peer and was left out of the generations for `join_timeout` (the error names both and their
            addresses); the store was unreachable for `timeout`; the ranks were in different operations
            (the script's bug); too many generations failed in a row before a step completed.
        TypeError: `fn` is not callable, `state` is neither an ``@elastic_state`` instance nor a builder,
            ``build(world)`` returned no sharded state, `mesh` or `snapshot_every` was given with a state,
            or `snapshot_every` is not an int.
        ValueError: a worker count, `check_every` or `snapshot_every` out of range, or an empty `run_id`.
    """
    _check_args(fn, min_workers, max_workers, first_workers, check_every, run_id)
    if snapshot_every is not None and (
        not isinstance(snapshot_every, int) or isinstance(snapshot_every, bool)
    ):
        msg = f"elastic.run(snapshot_every=...) must be an int >= 1 or None, got {snapshot_every!r}"
        raise TypeError(msg)
    _check_count("snapshot_every", 1 if snapshot_every is None else snapshot_every, 1)
    release_connections_in_forked_children()
    built: Built | None = None
    if callable(state) and not is_elastic_state(state):  # a builder: a sharded state on each mesh
        plan = MeshPlan(mesh if mesh is not None else (lambda n: (n,)), mesh_dim_names)
        built = Built(
            build=state,
            plan=plan,
            ckpt=ckpt,
            timeout=as_timedelta(timeout, "elastic.run") or DEFAULT_TIMEOUT,
            snapshot_every=snapshot_every,
        )
        _import_sharded()
        warm_up(plan)
    else:
        config_of(state, "elastic.run()")
        if mesh is not None or mesh_dim_names is not None:
            msg = (
                "elastic.run(fn, state, mesh=...): a mesh needs a builder, run(fn, build, mesh=...), where "
                "build(world) makes the sharded state on world.mesh"
            )
            raise TypeError(msg)
        if snapshot_every is not None:
            msg = (
                f"elastic.run(fn, state, snapshot_every={snapshot_every}): snapshots are for sharded states, "
                "run(fn, build, mesh=..., snapshot_every=k), where build(world) makes the state on "
                "world.mesh; "
                "a replicated state needs none (every rank holds all of it, and a lost worker costs at most "
                "the step in flight): drop snapshot_every"
            )
            raise TypeError(msg)
    if dist.is_initialized():
        raise ElasticError(_GROUP_EXISTS)
    td = as_timedelta(timeout, "elastic.run") or DEFAULT_TIMEOUT
    join_td = as_timedelta(join_timeout, "elastic.run") or DEFAULT_JOIN_TIMEOUT

    addresses = parse_addresses(rdzv)
    if len(addresses) == 1:
        store = connect(*addresses[0], timeout=td)
    else:
        store, _ = connect_first(addresses, timeout=td)

    def reconnect() -> Any:  # the first of the addresses that answers now (a restarted store, a standby)
        return connect_first(
            addresses, timeout=td, attempt=timedelta(seconds=min(td.total_seconds(), RECONNECT))
        )[0]

    participant = _participant_id()
    rendezvous = Rendezvous(
        store,
        run_id,
        participant,
        min_workers=min_workers,
        max_workers=max_workers,
        first_workers=first_workers,
        join_timeout=join_td,
        timeout=td,
        address=", ".join(format_address(h, p) for h, p in addresses),
        connect=reconnect,
        fit=built.plan.fit if built is not None else None,
    )
    links = _listen(rendezvous.client, run_id, participant, td)
    try:
        with _Departure() as departure:
            loop = _Loop(
                fn=fn,
                state=None if built is not None else state,
                store=store,
                rendezvous=rendezvous,
                departure=departure,
                backend=_backend(state, built),
                ckpt=ckpt,
                timeout=td,
                check_every=check_every,
                built=built,
                store_addresses=tuple(addresses),
                links=links,
            )
            return loop.run()
    finally:
        rendezvous.close()
        if links is not None:
            links.close()


def _listen(store: Any, run_id: str, participant: str, timeout: timedelta) -> Links | None:
    """This participant's listener for the members' link checks, published in the store; None (with a
    warning) when none can be bound or published: pairs that cannot connect then show only as failed
    collectives and group formations."""
    try:
        return Links(store, run_id, participant, probe_seconds(timeout.total_seconds()))
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning(
            "run: no listener for checking the links between workers (%s); a pair of workers that cannot "
            "connect will show only as failed collectives",
            exc,
        )
        return None


def _import_sharded() -> None:
    """Import what building and filling a sharded state uses (~2 s on a busy machine) before joining: a
    spare pays it while it waits, not when it is admitted with every member waiting for it.

    Also before any process group exists: ``torch.distributed.nn.functional`` (which FSDP2's first forward
    imports) takes ``group=dist.group.WORLD`` as the default of its functions, so imported during a
    generation it holds that generation's default group, and its sockets open, for the whole process."""
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.device_mesh
    import torch.distributed.fsdp
    import torch.distributed.nn.functional
    import torch.distributed.tensor  # noqa: F401


class _Live:
    """A formed generation's world, its process group and its watch; owns their teardown.

    `release` stops the watch and drops the world's reference to the group (before a failure is judged,
    so that nothing but torch holds the group); `end` destroys the group, aborting it first when asked,
    once. Leaving the ``with`` block ends a generation nobody ended (aborting it): no path leaks a group.
    `collect`: for a builder's state, whether something still holds one of the mesh's groups once they
    are destroyed (a state that could not let go of them: FSDP2's modules are reference cycles); `end`
    then runs a garbage collection (after the announcement: it holds the GIL, and so the heartbeat, for a
    while).
    """

    def __init__(self, world: World, watch: _Watch | None, collect: Callable[[], bool] | None = None) -> None:
        self.world = world
        self._watch = watch
        self._ended = False
        self._collect = collect

    def __enter__(self) -> _Live:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end(abort=True)

    def start(self) -> None:
        if self._watch is not None:
            self._watch.start()

    def training(self) -> None:
        """The generation started: ``fn`` runs (the watch judges heartbeats more tightly)."""
        if self._watch is not None:
            self._watch.training.set()

    def release(self) -> None:
        _Watch.stop(self._watch)
        self._watch = None
        self.world.group = None
        self.world.mesh = None  # its groups too

    def end(self, *, abort: bool, collect: bool = True) -> None:
        """Destroy the group (once); `collect`: unless the run is over (its state still holds the groups)."""
        self.release()
        if not self._ended:
            self._ended = True
            _end_group(abort=abort)
            if collect and self._collect is not None and self._collect():
                log.debug("a mesh group is still referenced after destroy; collecting garbage")
                gc.collect()


@attrs.define
class _Loop:
    """The generations of one `run` call: each forms, starts, runs ``fn`` and ends in one of four ways."""

    fn: Callable[[Any, World], Any]
    state: Any
    store: Any
    rendezvous: Any
    departure: _Departure
    backend: str
    ckpt: Any
    timeout: timedelta
    check_every: int
    built: Built | None = None
    #: the stores' (host, port): the watch never shuts down connections to them
    store_addresses: tuple[tuple[str, int], ...] = ()
    stalls: _Stalls = attrs.field(factory=lambda: _Stalls(STALL_LIMIT))
    ended_at: float = attrs.field(factory=time.monotonic)
    #: this participant's link checks (None: no listener could be bound, the checks are skipped)
    links: Links | None = None
    #: pairs found unable to connect when the last generation ended, not yet reported (`rejoin`)
    cut: Cut | None = None
    #: the last such pairs with that generation's members, until a generation forms (for error messages)
    last_cut: tuple[Cut, tuple[str, ...]] | None = None

    @property
    def probe(self) -> float:
        return _probe_seconds(self.timeout, self.rendezvous)

    def run(self) -> Any:
        while True:
            self.rendezvous.progress()
            if self.cut is not None:
                self.rejoin()
            try:
                membership = self.rendezvous.join()
            except ElasticError as exc:
                if self.last_cut is None:
                    raise
                cut, members = self.last_cut
                msg = f"{exc} (the last generation ended because {cut.describe(members)})"
                raise ElasticError(msg) from exc
            if membership is None:
                log.info("run: the run is already finished; nothing to do")
                return None
            outcome = self.generation(membership)
            if outcome is not _AGAIN:
                return outcome

    def rejoin(self) -> None:
        """After a generation some of whose members could not connect: report the pairs this participant
        found to the next round (whose decision keeps the largest set with no such pair), and when the same
        rule leaves this participant out, wait outside until its links heal (`Links.wait`) rather than
        join at once as a newcomer that the others would regroup for, and fail with, again."""
        cut, self.cut = self.cut, None
        me = str(getattr(self.rendezvous, "participant", ""))
        if cut is None or self.last_cut is None:
            return
        members = self.last_cut[1]
        report = getattr(self.rendezvous, "unreachable", None)
        if report is not None:
            report(cut.found_by(me))
        if self.links is None or me in largest_reachable(members, cut.pairs, prefer=members):
            return
        join_timeout = float(getattr(self.rendezvous, "join_timeout", DEFAULT_JOIN_TIMEOUT.total_seconds()))
        peers = sorted(cut.peers_of(me))
        log.warning(
            "run: left out: %s; the others go on without it (the largest set that all reach each other); "
            "waiting for %s to be reachable again (join_timeout=%g s)",
            cut.describe(members, [frozenset((me, q)) for q in peers]) or cut.describe(members),
            ", ".join(peers) or "the others",
            join_timeout,
        )
        began = time.monotonic()
        self.links.wait(
            cut, members, rdzv=self.rendezvous, join_timeout=join_timeout, finished=self._finished
        )
        log.info(
            "run: rejoining after %.1f s outside (the links healed or the peers are gone)",
            time.monotonic() - began,
        )

    def _finished(self) -> bool:
        """Has the run finished (a generation's function returned)? One store read; False when unknown."""
        run_id = getattr(self.rendezvous, "run_id", None)
        if run_id is None:
            return False
        try:
            client = getattr(self.rendezvous, "client", lambda: self.store)()
            return bool(dist.PrefixStore(f"elastic/{run_id}/", client).check([FINISHED]))
        except Exception:
            return False

    def _note_cut(self, cut: Cut, membership: Any) -> str:
        self.cut = cut
        self.last_cut = (cut, tuple(membership.members))
        return cut.describe(membership.members)

    def check_links(self, gen: _Generation, membership: Any) -> bool:
        """Before the group forms: do all members reach each other (`Links.find`)? False: regroup."""
        if self.links is None or membership.size < 2:
            return True
        wait = self.links.timeout + float(getattr(self.rendezvous, "grace", 3.0))
        found = self.links.find(
            gen.store,
            "form",
            membership.members,
            membership.rank,
            range(membership.size),
            rdzv=self.rendezvous,
            wait=wait,
        )
        if found.complete and not found.cut:
            self.last_cut = None
            return True
        self.ended_at = time.monotonic()
        if found.cut:
            gen.announce("members cannot connect to each other")
            why = self._note_cut(found.cut, membership)
            log.warning(
                "generation %d: not formed: %s; regrouping without one side", membership.generation, why
            )
        else:
            gen.announce("members did not compare their connections")
            log.warning(
                "generation %d: not formed: %s did not compare their connections within %.1f s (gone or "
                "stalled); regrouping",
                membership.generation,
                f"rank(s) {list(found.missing)}" if found.missing else "some members",
                wait,
            )
        return False

    def judge_links(self, gen: _Generation, membership: Any, ranks: set[int]) -> str | None:
        """`_judge`'s link check, with the members that failed too (`ranks`): the pairs in words, or None."""
        if self.links is None or membership.size < 2:
            return None
        wait = self.links.timeout + float(getattr(self.rendezvous, "grace", 3.0))
        found = self.links.find(
            gen.store, "judge", membership.members, membership.rank, ranks, rdzv=self.rendezvous, wait=wait
        )
        if not found.cut:
            return None
        return "members cannot connect to each other: " + self._note_cut(found.cut, membership)

    def generation(self, membership: Any) -> Any:
        """One generation: `_AGAIN` when the next one must form, else `run`'s return value."""
        # the rendezvous' client now: a new one after the store restarted
        client = getattr(self.rendezvous, "client", lambda: self.store)
        store = client()
        gen = _Generation(client, membership)
        if not self.check_links(gen, membership):
            return _AGAIN
        # The connections the generation's groups open from here on (gloo: what the watch shuts down).
        sockets = Sockets(keep=list(self.store_addresses)) if self.backend == "gloo" else None
        try:
            hold = getattr(self.rendezvous, "hold", contextlib.nullcontext)
            group = _new_group(store, membership, self.backend, self.timeout, hold=hold)
        except Exception as exc:
            _strip(exc)
            gen.announce("process group failed to form")
            _abort_group()
            log.warning(
                "generation %d: the process group did not form (%s: %s); regrouping",
                membership.generation,
                type(exc).__name__,
                _first_line(exc),
            )
            del exc
            if self.links is not None:  # the links broke since they were checked: evidence, if any, now
                me = membership.members[membership.rank]
                unreached = self.links.probe(membership.members)
                if unreached:
                    found = {(me, q): why for q, why in unreached.items()}
                    cut = Cut(found, self.links.addresses(membership.members))
                    log.warning("generation %d: %s", membership.generation, self._note_cut(cut, membership))
            self.ended_at = time.monotonic()
            return _AGAIN
        world = World(
            rank=membership.rank,
            size=membership.size,
            generation=membership.generation,
            group=group,
            rdzv=self.rendezvous,
            check_every=self.check_every,
            leave_requested=self.departure.requested.is_set,
            timeout=self.timeout,
            note=gen.note,
        )
        watch = _Watch(self.rendezvous, gen, group, sockets)
        del group
        collect = self.built.groups_alive if self.built is not None else None
        with _Live(world, watch, collect=collect) as live:
            return self.train(live, gen, membership)

    def train(self, live: _Live, gen: _Generation, membership: Any) -> Any:
        """Start the generation (load or sync), run ``fn`` and end the generation `live` holds."""
        started_at: Any = NOT_STARTED
        try:
            live.start()
            self.rendezvous.progress()
            if self.built is not None:
                src, started_at = self.built.start(live.world)
                self.state = self.built.state
                if self.built.snapshot_every is not None:
                    live.world._snapshot = (self.built.snapshot_every, self.built.snapshot)
            else:
                src, started_at = _start(self.state, self.ckpt, self.timeout)
            clear_grads(self.state)
            self.rendezvous.progress()
            log.info(
                "generation %d: %d workers, rank %d, source rank %d (tenure %r), regrouped in %.2f s",
                membership.generation,
                membership.size,
                membership.rank,
                src,
                started_at,
                time.monotonic() - self.ended_at,
            )
            live.training()
            result = self.fn(self.state, live.world)
        except _EndGeneration as end:
            self.ended_at = time.monotonic()
            _strip(end)  # first: its frames hold the state's objects
            self._release_state(wait=True)
            live.release()
            if not end.leaving:
                _announce(self.rendezvous)
            live.end(abort=False)
            self.stalls.succeeded()
            if end.leaving:
                log.info("generation %d: left as asked (SIGTERM)", membership.generation)
                return None
            log.info("generation %d: ends at this check(): a worker joins or leaves", membership.generation)
            return _AGAIN
        except BaseException as exc:
            self.ended_at = time.monotonic()
            _strip(exc)  # first: its frames hold the state's objects
            self._release_state()
            live.release()
            return self.failed(exc, live, gen, membership, started_at)
        if self.built is not None:
            self.built.snapshots.close(wait=True)  # every rank ends alike: the round in flight completes
        live.release()
        self.rendezvous.finish()
        live.end(abort=False, collect=False)
        return result

    def _release_state(self, *, wait: bool = False) -> None:
        """A builder's state: its pieces kept, the state (and its hold on the groups) dropped; `wait`: for
        the snapshot in flight (the generation ended by agreement)."""
        if self.built is not None:
            self.state = None  # first: `release` collects the state once nothing else holds it
            try:
                self.built.release(wait=wait)
            except Exception as exc:  # the next generation reads what is left (or ckpt)
                log.warning("run: keeping the pieces of the ended generation failed: %s", exc)
                self.built.state = None

    def failed(
        self, exc: BaseException, live: _Live, gen: _Generation, membership: Any, started_at: Any
    ) -> Any:
        """The generation failed on this rank with `exc`: regroup (`_AGAIN`), return None, or raise."""
        if not (isinstance(exc, Exception) and _communication_kind(exc)):
            gen.announce(f"raised {type(exc).__name__}")
            live.end(abort=True)
            raise exc
        # Record where this rank was and abort at once: every peer blocked on this rank fails now and
        # records where it was, so that `_judge` sees every member within milliseconds. The next round
        # hears first that this member is on its way (the abort may hold the GIL, and so the heartbeat).
        leaving = self.departure.requested.is_set()
        if not leaving:
            _announce(self.rendezvous)
        gen.record(where_of(exc))
        live.end(abort=True)
        links = functools.partial(self.judge_links, gen, membership)
        verdict = _judge(exc, self.rendezvous, gen, self.probe, self.timeout, links=links)
        if verdict.startswith(MISMATCH):
            gen.announce("raised ElasticError")
            raise ElasticError(verdict[len(MISMATCH) :]) from exc
        if not verdict.startswith(REGROUP):
            gen.announce(f"raised {type(exc).__name__}")
            raise exc
        why = verdict[len(REGROUP) :]
        if leaving:
            self.rendezvous.leave()  # SIGTERM came first: the others need not wait for this member
        gen.announce("saw the group fail")
        text = _first_line(exc) or type(exc).__name__
        stalled = self.stalls.failed(membership.generation, started_at, _tenure_now(self.state), why)
        del exc
        log.warning(
            "generation %d: communication failed (%s: %s); regrouping", membership.generation, why, text
        )
        if leaving:
            log.info("generation %d: SIGTERM received; not rejoining", membership.generation)
            return None
        if stalled is not None:
            self.rendezvous.leave()
            raise stalled
        return _AGAIN


#: `_Loop.generation`'s value when the next generation must form.
_AGAIN: Any = object()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else ""
