"""Collectives with a deadline: every wait is bounded and every failure names its phase and rank."""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic._util.errors import ElasticError, SyncError
from elastic._util.placement import Placement

__all__ = ["Comm", "FaultInjected", "fault_point", "tensor_bytes"]

log = logging.getLogger("elastic")

#: Bytes each rank contributes to the first round of an all-gather; larger records take a second round.
INLINE_BYTES = 4096


class FaultInjected(RuntimeError):
    """Raised by `fault_point` when a test asked this rank to fail at this phase."""


def fault_point(phase: str, rank: int) -> None:
    """Test hook: with ``ELASTIC_FAULT="<rank>:<phase>[:die]"`` set, rank `rank` fails at `phase`.

    `phase` is matched exactly ("elect", "objects", "bucket 0", "direct 0", "apply", "commit",
    "write", "rename", ...). With ":die" the process exits at once (as a killed worker would);
    otherwise it raises `FaultInjected`. Unset, this costs one dictionary lookup.
    """
    spec = os.environ.get("ELASTIC_FAULT")
    if not spec:
        return
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) >= 2 and parts[0] == str(rank) and parts[1] == phase:
            if len(parts) > 2 and parts[2] == "die":
                log.warning("fault injected: rank %d dies at %s", rank, phase)
                os._exit(17)
            msg = f"fault injected on rank {rank} at {phase}"
            raise FaultInjected(msg)


def _check_alone(op: str) -> None:
    """Refuse to act locally when a launcher says this process is one of several ranks."""
    text = os.environ.get("WORLD_SIZE", "")
    try:
        world = int(text)
    except ValueError:
        return
    if world > 1:
        msg = (
            f"{op}: WORLD_SIZE={world} says this process is one of {world} ranks, but no process group is "
            f"initialised, so {op}() would act on this rank alone (every rank training and checkpointing "
            "by itself); call elastic.init_process_group() at the start of the worker (or unset "
            "WORLD_SIZE to run alone)"
        )
        raise ElasticError(msg)


class Comm:
    """A process group, this rank's place in it, the device its collectives use and their deadline."""

    def __init__(self, group: Any, timeout: timedelta | None, op: str) -> None:
        self.group = group
        self.op = op
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.placement = Placement.for_backend(self.backend)
        self.device = self.placement.device

    @classmethod
    def of(cls, group: Any, timeout: timedelta | None, op: str) -> Comm | None:
        """The group to use, or `None` when there is nothing to talk to (no group or a world of one)."""
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                msg = f"{op}(group=...) was given a group but torch.distributed is not initialised"
                raise ValueError(msg) from None
            _check_alone(op)
            return None
        comm = cls(group, timeout, op)
        return comm if comm.world_size > 1 else None

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -----------------------------------------------------------------------------------------------
    def wait(self, work: Any, phase: str) -> None:
        """Wait for `work` within the deadline, turning any failure into a `SyncError` naming `phase`."""
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(self.timeout)
        except Exception as exc:
            raise self.failure(phase, exc) from exc

    def failure(self, phase: str, exc: BaseException) -> SyncError:
        """A `SyncError` naming `phase`, this rank and the first line of torch's error.

        Raise it ``from exc``: torch's full error (stack, backend details) stays the cause."""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "timed out" in text.lower() or "timeout" in text.lower():
            limit = f"{self.timeout.total_seconds():g}s" if self.timeout else "the group's timeout"
            msg = (
                f"{self.op} timed out in phase '{phase}' on rank {self.rank} after {limit}: a peer did not "
                f"take part. Every rank of the group must call {self.op}() at the same point; a peer that "
                f"died or is stuck elsewhere causes this ({text})"
            )
        else:
            msg = (
                f"{self.op} failed in phase '{phase}' on rank {self.rank}: {text}. A peer probably died; "
                "re-form the process group (or let torchrun restart the workers) and sync again"
            )
        return SyncError(msg, phase=phase, op=self.op)

    def run(self, phase: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Issue a collective (`async_op=True` is added) and wait for it."""
        try:
            work = fn(*args, group=self.group, async_op=True, **kwargs)
        except Exception as exc:
            raise self.failure(phase, exc) from exc
        self.wait(work, phase)
        return work

    def issue(self, phase: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Issue a collective asynchronously; the caller waits with `wait`."""
        try:
            return fn(*args, group=self.group, async_op=True, **kwargs)
        except Exception as exc:
            raise self.failure(phase, exc) from exc

    # -----------------------------------------------------------------------------------------------
    def all_gather_bytes(self, data: bytes, phase: str, inline: int = INLINE_BYTES) -> list[bytes]:
        """Every rank's `data`, in rank order: one collective when each record fits in `inline` bytes (the
        same on every rank), else a second one."""
        fault_point(phase, self.rank)
        room = inline - 8
        first = torch.zeros(inline, dtype=torch.uint8)
        first[:8] = torch.frombuffer(bytearray(struct.pack("<q", len(data))), dtype=torch.uint8)
        if len(data) <= room and data:
            first[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        first = self.placement.stage(first)
        out = [torch.empty_like(first) for _ in range(self.world_size)]
        self.run(phase, dist.all_gather, out, first)
        rows = [tensor_bytes(t) for t in out]
        sizes = [struct.unpack("<q", r[:8])[0] for r in rows]
        if max(sizes) <= room:
            return [r[8 : 8 + n] for r, n in zip(rows, sizes)]
        longest = max(sizes)
        second = torch.zeros(longest, dtype=torch.uint8)
        if data:
            second[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        second = self.placement.stage(second)
        out2 = [torch.empty_like(second) for _ in range(self.world_size)]
        self.run(phase, dist.all_gather, out2, second)
        return [tensor_bytes(t)[:n] for t, n in zip(out2, sizes)]

    def any_rank(self, flag: bool, phase: str) -> bool:
        """Whether `flag` is true on any rank (one all-reduce); the same answer on every rank."""
        fault_point(phase, self.rank)
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        self.run(phase, dist.all_reduce, value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def broadcast_bytes(self, data: bytes | None, src: int, phase: str) -> bytes:
        """`data` from group rank `src` to every rank (size first, then the bytes)."""
        fault_point(phase, self.rank)
        gsrc = self.global_rank(src)
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self.run(phase, dist.broadcast, size, gsrc)
        n = int(size.item())
        if self.rank == src:
            assert data is not None
            buf = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if n
                else torch.empty(0, dtype=torch.uint8)
            )
            buf = self.placement.stage(buf)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self.run(phase, dist.broadcast, buf, gsrc)
        return tensor_bytes(buf)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a 1-D uint8 tensor (copied to the CPU first), without numpy."""
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""
