"""Run a function on N real gloo ranks in fresh processes and bring back results or tracebacks.

Like torchsnapshot's test decorator: each rank is a spawned interpreter with the default process group
initialised (gloo over loopback, a fresh port per call); the function travels with cloudpickle, so
closures and lambdas defined in a test work.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import cloudpickle


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    payload: bytes, rank: int, world: int, port: int, queue: Any, pg_timeout: float, init_group: bool
) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    try:
        fn, args, env = cloudpickle.loads(payload)
        os.environ.update(env.get(rank, {}) if isinstance(env, dict) else {})
        if init_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout)
            )
        result = fn(rank, world, *args)
        queue.put((rank, "ok", cloudpickle.dumps(result)))
    except BaseException as exc:  # report everything, including SystemExit from a test body
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        queue.close()
        queue.join_thread()  # flush the result before the hard exit below
    os._exit(0)


class RankFailure(AssertionError):
    pass


def run_on_ranks(
    fn: Callable[..., Any],
    world: int = 2,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 90.0,
    pg_timeout: float = 30.0,
    env: dict[int, dict[str, str]] | None = None,
    allow_exit: bool = False,
    init_group: bool = True,
) -> list[Any]:
    """`fn(rank, world, *args)` on `world` gloo ranks; results in rank order.

    A rank that raises makes this raise `RankFailure` with every failing rank's traceback. With
    `allow_exit`, a rank that exits without reporting (a simulated crash) yields `None` as its result.
    With `init_group=False` the processes start without a process group (MASTER_PORT is still set to a
    free port the body may use for its own store).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    payload = cloudpickle.dumps((fn, args, env or {}))
    procs = [
        ctx.Process(target=_worker, args=(payload, r, world, port, queue, pg_timeout, init_group))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, status, data = queue.get(timeout=0.2)
            except Exception:
                if all(not p.is_alive() for p in procs):
                    # every process ended: drain what is left, then stop waiting
                    time.sleep(0.2)
                    while not queue.empty():
                        rank, status, data = queue.get()
                        (results if status == "ok" else errors)[rank] = (
                            cloudpickle.loads(data) if status == "ok" else data
                        )
                    break
                continue
            if status == "ok":
                results[rank] = cloudpickle.loads(data)
            else:
                errors[rank] = data
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(errors.items()))
        raise RankFailure(f"{len(errors)} rank(s) failed:\n{text}")
    missing = [r for r in range(world) if r not in results]
    if missing and not allow_exit:
        codes = {r: procs[r].exitcode for r in missing}
        raise RankFailure(f"ranks {missing} reported nothing (exit codes {codes}) within {timeout}s")
    return [results.get(r) for r in range(world)]


#: The transports the sync-heavy tests run on: the default (shared memory on one host) and the broadcasts
#: every other group uses.
TRANSPORTS = ("shared-memory", "broadcast")


def use_transport(kind: str, *, bucket_bytes: int, direct_bytes: int | None = None) -> None:
    """Make `kind` (one of `TRANSPORTS`, or "cross-memory": reads from the source's memory, else the
    shared-memory ring) the default transport, with buckets small enough that a test's small state spans
    many of them (and the shared-memory paths are taken however few bytes move)."""
    from elastic.replication.transport import broadcast, cma, default, shm

    options: dict[str, int] = {"bucket_bytes": bucket_bytes}
    if direct_bytes is not None:
        options["direct_bytes"] = direct_bytes
    fallback = broadcast.BroadcastTransport(**options)
    if kind == "broadcast":
        default.set_default_transport(fallback)
    elif kind in ("shared-memory", "cross-memory"):
        ramp = min(broadcast.RAMP_MIN, bucket_bytes)
        ring = shm.SharedMemoryTransport(
            bucket_bytes=bucket_bytes, min_bytes=0, ramp_min=ramp, fallback=fallback
        )
        default.set_default_transport(ring if kind == "shared-memory" else cma.CrossMemoryTransport(0, ring))
    else:
        msg = f"unknown transport {kind!r}; use one of {TRANSPORTS}"
        raise ValueError(msg)


@contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """Count the all-reduces and broadcasts issued inside the block (the transports look them up at call
    time)."""
    import torch.distributed as dist

    counts = {"all_reduce": 0, "broadcast": 0}
    real = {name: getattr(dist, name) for name in counts}

    def wrap(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real[name](*args, **kwargs)

        return call

    for name in counts:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
