"""The `Transport` seam: how `sync` moves the source's tensors to every receiver.

`sync` talks to a transport object: the source asks it for a `plan` of its tensors (a picklable value that
travels to the receivers with the tensor metadata), then the source calls `send` and every receiver
`receive`, each with the same metadata and plan; a receiver allocates the tensors it lacks on
`device_for(meta, comm)`. `BroadcastTransport` (the group's broadcasts), `CrossMemoryTransport` (reads
from the source's memory on one host), `SharedMemoryTransport` (a memfd ring on one host) and
`TcpTransport` (connections of its own between hosts) implement it; another transport (point-to-point
sends to a joining rank, a CUDA-IPC or RDMA path) implements the same four methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from elastic.replication.comm import Comm
from elastic.state.tensors import TensorMeta

__all__ = ["OnError", "Transport", "at_least"]

OnError = Callable[[BaseException], None]


@runtime_checkable
class Transport(Protocol):
    """How `sync` moves the source's tensors to every receiver once the objects are known.

    Every method is called on every rank of the transfer with the same `metas` and `plan`. A local
    failure (packing, writing) goes to `on_error` and the transfer goes on, so that no rank is left
    waiting; a communication failure raises `SyncError` (from `Comm`).
    """

    def plan(self, tensors: list[torch.Tensor], comm: Comm) -> Any:
        """The source's plan for moving `tensors` (picklable: it travels with the tensor metadata)."""
        ...

    def device_for(self, meta: TensorMeta, comm: Comm) -> torch.device:
        """Where a receiver allocates an incoming tensor it has no place for."""
        ...

    def send(
        self,
        comm: Comm,
        src: int,
        tensors: list[torch.Tensor],
        metas: list[TensorMeta],
        plan: Any,
        on_error: OnError,
    ) -> None:
        """The source's half (never writes to `tensors`)."""
        ...

    def receive(
        self,
        comm: Comm,
        src: int,
        targets: list[torch.Tensor],
        metas: list[TensorMeta],
        plan: Any,
        on_error: OnError,
    ) -> None:
        """The receivers' half: the source's tensors written into `targets` (in place: storage kept)."""
        ...


def at_least(low: int) -> Callable[[Any, Any, Any], None]:
    """An attrs validator of a transport's option: an int (not a bool) of at least `low`, else a
    `ValueError` naming the transport, the option and the value."""

    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            name = type(instance).__name__
            msg = f"{name}({attribute.name}=...) must be an int of at least {low}, got {value!r}"
            raise ValueError(msg)

    return check
