"""`elastic.init_process_group`: a torchrun-safe start of the default process group.

torchrun's agent shares its rendezvous TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``,
``MASTER_ADDR``/``MASTER_PORT`` point at it) and does not namespace the workers' keys per restart. After a
restart the new workers find their predecessors' keys (peer addresses) in that store and may fail or hang
inside ``torch.distributed.init_process_group`` (pytorch/pytorch#135712). Here the workers connect to the
same store as clients and put their keys under a prefix naming the restart, so every attempt starts from
an empty namespace. Outside torchrun this is torch's env:// initialisation.
"""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic._util.errors import ElasticError
from elastic._util.timeouts import as_timedelta

__all__ = ["init_process_group", "store_prefix"]

log = logging.getLogger("elastic")

_warned_shared_store = False


def store_prefix(restart_count: int | str) -> str:
    """The prefix under which attempt `restart_count` of a torchrun job keeps its process-group keys."""
    return f"elastic/restart{restart_count}"


def _env(name: str, why: str) -> str:
    value = os.environ.get(name)
    if not value:
        msg = (
            f"elastic.init_process_group: environment variable {name} is not set ({why}); start the "
            f"workers with torchrun or elastic.spawn, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
        raise ElasticError(msg)
    return value


def _env_int(name: str, why: str) -> int:
    value = _env(name, why)
    try:
        return int(value)
    except ValueError as exc:
        msg = f"elastic.init_process_group: environment variable {name}={value!r} is not an integer"
        raise ElasticError(msg) from exc


def _uses_agent_store() -> bool:
    """True under a torchrun agent that shares its rendezvous store with its workers (the default)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _warn_several_agents() -> None:
    global _warned_shared_store
    group_world_size = os.environ.get("GROUP_WORLD_SIZE", "1")
    if _warned_shared_store or not group_world_size.isdigit() or int(group_world_size) <= 1:
        return
    _warned_shared_store = True
    msg = (
        f"elastic.init_process_group: this job has {group_world_size} torchrun agents sharing the "
        "rendezvous TCPStore with their workers; restart counts differ between agents, so keys of "
        "different attempts can mix and restarted workers may hang. Launch the job with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set in every agent's environment."
    )
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _set_cuda_device() -> None:
    local_rank = _env_int("LOCAL_RANK", "the nccl backend picks the CUDA device from it")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        msg = (
            f"elastic.init_process_group: LOCAL_RANK={local_rank} but this machine has {count} CUDA "
            f"device(s); start at most {count} workers per machine for backend 'nccl', or use 'gloo'"
        )
        raise ElasticError(msg)
    torch.cuda.set_device(local_rank)


def agent_store(timeout: timedelta) -> dist.Store:
    """A client of the torchrun agent's store, namespaced by ``TORCHELASTIC_RESTART_COUNT``."""
    why = "torchrun sets it for its workers"
    host = _env("MASTER_ADDR", why)
    port = _env_int("MASTER_PORT", why)
    restart = _env_int("TORCHELASTIC_RESTART_COUNT", why)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(store_prefix(restart), store)


def init_process_group(backend: str | None = None, *, timeout: timedelta | float | None = None) -> None:
    """Start the default process group of this worker from torchrun's (or env://) variables.

    Call it instead of ``torch.distributed.init_process_group()``. Under torchrun with its shared
    rendezvous store (the default), it connects to that store and keeps the keys of each restart under a
    prefix of their own (``elastic/restart<TORCHELASTIC_RESTART_COUNT>``), so restarted workers never
    read their predecessors' addresses (pytorch/pytorch#135712). Outside torchrun it is torch's env://
    initialisation (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

    Args:
        backend: the backend name; None picks ``"nccl"`` when CUDA is available, else ``"gloo"``. With
            nccl the current CUDA device becomes ``LOCAL_RANK``.
        timeout: bound of the process group's collectives and of its store (seconds or ``timedelta``);
            None keeps torch's default.

    Raises:
        ElasticError: the default process group already exists (the error `elastic.run` raises then too);
            a launcher variable (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) is missing or not an
            integer; ``LOCAL_RANK`` names no CUDA device of this machine for nccl.
        TypeError: bad arguments.

    Warns:
        RuntimeWarning: once, with several torchrun agents (``GROUP_WORLD_SIZE`` > 1) and torchrun's
            shared store: launch the job with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    """
    td = as_timedelta(timeout, "elastic.init_process_group")
    if backend is None:
        backend = _default_backend()
    if not isinstance(backend, str) or not backend:
        msg = (
            f"elastic.init_process_group(backend=...) must be a backend name such as 'gloo', got {backend!r}"
        )
        raise TypeError(msg) from None
    if dist.is_initialized():
        msg = (
            "elastic.init_process_group: the default process group is already initialised (backend "
            f"{dist.get_backend()!r}); call it once per process, or "
            "torch.distributed.destroy_process_group() first"
        )
        raise ElasticError(msg)
    if "nccl" in backend:
        _set_cuda_device()
    why = "the launcher sets it"
    rank = _env_int("RANK", why)
    world_size = _env_int("WORLD_SIZE", why)
    if _uses_agent_store():
        _warn_several_agents()
        from torch.distributed.constants import default_pg_timeout

        store = agent_store(td or default_pg_timeout)
        log.debug(
            "init_process_group: rank %d/%d on torchrun's store %s:%s under %r",
            rank,
            world_size,
            os.environ.get("MASTER_ADDR"),
            os.environ.get("MASTER_PORT"),
            store_prefix(os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")),
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td)
    else:
        _env("MASTER_ADDR", why)
        _env_int("MASTER_PORT", why)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=td)
