"""GPU check: run elastic's CUDA paths once, check every value, time them against plain torch.

One script, one call on a machine with one GPU (an H200 here; well under 10 minutes at the default sizes),
that prints a table and exits non-zero when any value is wrong. Its parts:

- sync: two gloo ranks on the one GPU (``elastic.spawn``), each with a state on ``cuda:0``: a model of
  ``--model-gib`` in ``--tensors`` parameters (half large weights, half 4 KiB biases) plus Adam. Rank 0
  is more tenured. Checked: the sync report, that rank 1 received every tensor in place (``data_ptr`` and
  the parameter objects kept) with rank 0's exact values, that rank 0's state is unchanged, that `verify`
  passes and catches a one-element divergence, and that a second `sync` takes the fast path
  (``tensor_bytes == 0``). Timed: ``sync(force=True)`` against one flat broadcast of the same bytes
  through the same path (gloo moves CPU bytes: device to host, broadcast, host to device), interleaved
  over ``--rounds`` rounds, each round the slower rank's time.
- ckpt: a state of ``--ckpt-gib`` (model plus Adam's moments) on ``cuda:0``, saved to ``--dir``: a blocking
  save; two ``save(blocking=False)``, timing how long each blocks the caller (staging into pinned host
  memory, reused by the second) while the state is changed right after the second returns; `load` into
  the existing CUDA tensors (in place, the second async save's values); the same state through
  ``torch.save`` (plus fsync, as elastic fsyncs) and ``torch.load`` with ``load_state_dict``.
- world1: a world of one under NCCL (``elastic.init_process_group("nccl")``): `sync`, `verify`, the object
  payload path on the backend's device, the source's half of the tensor transfer, `save`, `load` and an
  async save, without error and with the right values.
- sharded: issue 20's FSDP2 state (``fully_shard`` on a 1-D ``("shard",)`` mesh, a model with a
  BatchNorm's buffers, Adam, one step taken) in a world of one under NCCL: `sync` (a world of one moves
  nothing), `save` (a DCP checkpoint), the full state gathered (``get_model_state_dict`` and
  ``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True``); then two CPU gloo ranks
  (``elastic.spawn``) build the same model on a mesh of two from another seed, `load` the checkpoint
  (resharded from one piece to two) and gather their full state, compared bit for bit with the saved one.
- Peak GPU memory of every step (``torch.cuda.max_memory_allocated``, reset before the step), with the
  rise over what the process held before it.

Without CUDA every part runs its CPU analogue (states on the CPU, gloo for the world of one, small sizes
by default) and the table says which CUDA parts are SKIPPED and why; the exit status is 0 when every value
is right. ``tests/test_gpu_check.py`` runs it that way.

    python benchmarks/gpu_check.py                          # defaults: 1 GiB sync model, 8 GiB checkpoint
    python benchmarks/gpu_check.py --model-gib 0.25 --ckpt-gib 1 --tensors 200 --dir /mnt/disk/x
    bash benchmarks/gpu_check.sh                            # on the device machine (see its header)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

import elastic

MiB = 2**20
GiB = 2**30
#: Bytes of each small ("bias") tensor.
SMALL_BYTES = 4096
#: Values a row's status takes; WRONG and ERROR make the exit status 1.
OK, WRONG, ERROR, INFO, SKIPPED = "ok", "WRONG", "ERROR", "info", "SKIPPED"
#: Parts of the check, in the order they run.
PARTS = ("sync", "ckpt", "world1", "sharded")


@elastic.elastic_state(tenure="step")
@attrs.define
class CheckState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0


class Blob(torch.nn.Module):
    """A model that is only its parameters (their sizes are what matters here)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(p) for p in params])


@attrs.define
class Row:
    part: str
    step: str
    status: str
    value: str = ""
    peak: str = ""


# ---------------------------------------------------------------------------------------------------------
# States


def param_sizes(model_bytes: int, count: int) -> list[int]:
    """fp32 element counts of `count` parameters summing to about `model_bytes`: half of them large
    ("weights"), half `SMALL_BYTES` ("biases"), interleaved as in a real network."""
    count = max(2, count)
    n_small = count // 2
    n_large = count - n_small
    small = SMALL_BYTES // 4
    large = max(1, (model_bytes - n_small * SMALL_BYTES) // 4 // n_large)
    return [large if i % 2 == 0 else small for i in range(count)]


def build(seed: int, device: torch.device, model_bytes: int, count: int, step: int) -> CheckState:
    """A model with Adam's state after some steps, the same for the same seed and device (bitwise).

    The moments are drawn rather than computed (an optimizer step costs seconds on a small CPU and adds
    nothing here); as with ``Adam(foreach=None)``, ``step`` is a CPU tensor also for CUDA parameters.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    params = [torch.randn(n, generator=g, device=device) for n in param_sizes(model_bytes, count)]
    model = Blob(params)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(float(step + seed)),
            "exp_avg": torch.randn(p.shape, generator=g, device=device),
            "exp_avg_sq": torch.rand(p.shape, generator=g, device=device),
        }
    return CheckState(model, opt, step)


def tensors_of(state: CheckState) -> list[torch.Tensor]:
    """Every tensor of the state in a fixed order: the parameters, then each one's optimizer state."""
    params = list(state.model.parameters())
    out: list[torch.Tensor] = [p.detach() for p in params]
    for p in params:
        per = state.optimizer.state.get(p, {})
        out.extend(per[k] for k in sorted(per) if isinstance(per[k], torch.Tensor))
    return out


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def same_values(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[int, int]:
    """How many pairs are bitwise equal (same shape, dtype and values), and how many pairs there are."""
    if len(a) != len(b):
        return 0, max(len(a), len(b))
    good = sum(
        1
        for x, y in zip(a, b)
        if x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.to(y.device), y)
    )
    return good, len(a)


def in_place(state: CheckState, ptrs: list[int], params: Sequence[torch.Tensor]) -> tuple[bool, str]:
    """Whether every tensor kept its storage and the optimizer still holds the model's parameters."""
    now = tensors_of(state)
    kept = sum(1 for t, p in zip(now, ptrs) if t.data_ptr() == p) if len(now) == len(ptrs) else 0
    same_params = all(a is b for a, b in zip(state.model.parameters(), params))
    opt_params = all(
        a is b for a, b in zip(state.optimizer.param_groups[0]["params"], state.model.parameters())
    )
    ok = kept == len(ptrs) == len(now) and same_params and opt_params
    text = f"{kept}/{len(ptrs)} data_ptr kept; parameter objects {'kept' if same_params else 'REPLACED'}"
    if not opt_params:
        text += "; optimizer holds other tensors than the model"
    return ok, text


def corrupt(t: torch.Tensor) -> None:
    """Change one element (the check's own check: `--inject-wrong`)."""
    with torch.no_grad():
        t.view(-1)[0] += 1


# ---------------------------------------------------------------------------------------------------------
# Measuring


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Peak:
    """Peak GPU memory of one step: ``max_memory_allocated`` reset before it, and its rise over the start."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.base = 0
        self.peak = 0

    def __enter__(self) -> Peak:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)

    def text(self) -> str:
        if not self.cuda:
            return "-"
        return f"{self.peak / MiB:.0f} (+{self.extra / MiB:.0f})"


@contextlib.contextmanager
def timed(out: list[float]) -> Iterator[None]:
    """Append the seconds the block took, device work included."""
    cuda_sync()
    t0 = time.perf_counter()
    yield
    cuda_sync()
    out.append(time.perf_counter() - t0)


def gbps(n: int, seconds: float) -> str:
    return f"{n / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"


# ---------------------------------------------------------------------------------------------------------
# Part 1: two gloo ranks on the one GPU


def sync_worker(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs on each of the two gloo ranks (in `elastic.spawn`); returns this rank's rows."""
    rank = dist.get_rank()
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=cfg["timeout"])
    rows: list[dict[str, Any]] = []

    def row(step: str, ok: bool | None, value: str, peak: Peak | str | None = None) -> None:
        status = INFO if ok is None else (OK if ok else WRONG)
        rows.append({"step": step, "status": status, "value": value, "peak": peak})

    model_bytes, count = cfg["model_bytes"], cfg["tensors"]
    state = build(seed=rank, device=device, model_bytes=model_bytes, count=count, step=2 - rank)
    mine = tensors_of(state)
    total = nbytes(mine)
    ptrs = [t.data_ptr() for t in mine]
    params = list(state.model.parameters())
    if rank == 0:
        row("state", None, f"{total / GiB:.3f} GiB in {len(mine)} tensors on {device} per rank")

    with Peak(device) as pk:
        report = elastic.sync(state, timeout=timeout)
    row(
        "sync: report (src 0, all bytes moved)",
        report.src == 0 and report.world_size == 2 and report.tensor_bytes == total,
        f"src {report.src}, {report.tensor_bytes / GiB:.3f} GiB, {report.seconds:.2f} s",
        pk,
    )
    if rank == 1 and "sync" in cfg["inject"]:
        corrupt(tensors_of(state)[0])
    ok, text = in_place(state, ptrs, params)
    row("sync: in place" if rank == 1 else "sync: source untouched (storage)", ok, text)
    expected = tensors_of(build(seed=0, device=device, model_bytes=model_bytes, count=count, step=2))
    good, n = same_values(tensors_of(state), expected)
    what = "values equal rank 0's" if rank == 1 else "source values unchanged"
    row(f"sync: {what}", good == n, f"{good}/{n} tensors bitwise equal")
    del expected

    with Peak(device) as pk:
        try:
            elastic.verify(state, timeout=timeout)
            row("verify: replicas agree", True, "no divergence", pk)
        except elastic.DivergenceError as exc:
            row("verify: replicas agree", False, str(exc).splitlines()[1].strip()[:60], pk)
    target = tensors_of(state)[-3]  # a moment of the last parameter
    saved = target.clone()
    if rank == 1:
        corrupt(target)
    try:
        elastic.verify(state, timeout=timeout)
        row("verify: catches a one-element change", False, "no DivergenceError raised")
    except elastic.DivergenceError as exc:
        row("verify: catches a one-element change", "1 place" in str(exc), "DivergenceError on every rank")
    target.copy_(saved)
    del saved

    times: list[float] = []
    with Peak(device) as pk, timed(times):
        report = elastic.sync(state, timeout=timeout)
    row(
        "sync: fast path (tensor_bytes == 0)",
        report.tensor_bytes == 0 and report.object_bytes == 0,
        f"tensor_bytes {report.tensor_bytes}, {times[-1] * 1e3:.1f} ms",
        pk,
    )

    # Timing: sync(force=True) against one flat broadcast of the same bytes through the same path.
    g = torch.Generator(device=device).manual_seed(99)
    flat = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device, generator=g)
    host = flat if device.type == "cpu" else torch.empty(total, dtype=torch.uint8)

    def flat_broadcast() -> None:
        if device.type == "cpu":
            dist.broadcast(flat, 0)
            return
        if rank == 0:
            host.copy_(flat)
        dist.broadcast(host, 0)
        if rank != 0:
            flat.copy_(host)

    def forced() -> None:
        elastic.sync(state, force=True, timeout=timeout)

    def verify() -> None:
        elastic.verify(state, timeout=timeout)

    methods: dict[str, Callable[[], None]] = {"flat": flat_broadcast, "sync": forced, "verify": verify}
    samples: dict[str, list[float]] = {k: [] for k in methods}
    peaks: dict[str, int] = dict.fromkeys(methods, 0)
    names = list(methods)
    for r in range(cfg["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            mine_t: list[float] = []
            with Peak(device) as pk, timed(mine_t):
                methods[name]()
            peaks[name] = max(peaks[name], pk.extra)
            slowest = torch.tensor([mine_t[0]], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            samples[name].append(float(slowest.item()))
    med = {k: statistics.median(v) for k, v in samples.items()}
    path = "D2H, gloo, H2D" if device.type == "cuda" else "gloo, CPU"
    cuda = device.type == "cuda"
    row(
        "time: sync(force=True) vs one flat broadcast",
        None,
        f"{med['sync']:.3f} s vs {med['flat']:.3f} s ({path}): {med['sync'] / med['flat']:.2f}x; "
        f"{gbps(total, med['sync'])}",
        _fixed_peak(cuda, peaks["sync"]),
    )
    row(
        "time: verify (digest every byte)", None, f"{med['verify']:.3f} s", _fixed_peak(cuda, peaks["verify"])
    )
    row("time: flat broadcast (baseline)", None, f"{med['flat']:.3f} s", _fixed_peak(cuda, peaks["flat"]))
    return [
        {**r, "peak": r["peak"].text() if isinstance(r["peak"], Peak) else (r["peak"] or "")} for r in rows
    ]


def _fixed_peak(cuda: bool, extra: int) -> Peak | str:
    return f"(+{extra / MiB:.0f})" if cuda else "-"


def merged(values: list[str]) -> str:
    """One rank's value when every rank's is the same, else ``r0: ...; r1: ...``."""
    unique = list(dict.fromkeys(values))
    return unique[0] if len(unique) == 1 else "; ".join(f"r{i}: {v}" for i, v in enumerate(values))


def run_sync_part(cfg: dict[str, Any]) -> list[Row]:
    per_rank = elastic.spawn(sync_worker, nprocs=2, args=(cfg,), backend="gloo", timeout=cfg["timeout"] * 2)
    rows: list[Row] = []
    by_step: dict[str, list[dict[str, Any]]] = {}
    for i in range(max(len(rs) for rs in per_rank)):  # interleaved: each rank's rows keep their order
        for rank_rows in per_rank:
            if i < len(rank_rows):
                by_step.setdefault(rank_rows[i]["step"], []).append(rank_rows[i])
    for step, found in by_step.items():
        statuses = {r["status"] for r in found}
        status = WRONG if WRONG in statuses else next(iter(statuses))
        value = merged([r["value"] for r in found])
        peaks = [r["peak"] for r in found if r["peak"] and r["peak"] != "-"]
        rows.append(Row("sync", step, status, value, " / ".join(peaks) if peaks else "-"))
    return rows


# ---------------------------------------------------------------------------------------------------------
# Part 2: save and load


def _disk_sync() -> None:
    if hasattr(os, "sync"):
        os.sync()


def _drop_cache(path: Path) -> None:
    """Evict the files under `path` from the page cache (they are synced), so that loads read the disk."""
    if not hasattr(os, "posix_fadvise"):
        return
    files = [path]
    with contextlib.suppress(OSError):  # retention may be deleting an older checkpoint meanwhile
        if path.is_dir():
            dirs = [d for d in path.iterdir() if d.is_dir() and not d.name.startswith(".")]
            files = [f for d in dirs for f in d.iterdir() if f.is_file()]
    for f in files:
        with contextlib.suppress(OSError):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _host_stat(key: str) -> int:
    """One counter of torch's pinned host allocator (0 where this torch has none)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return int(stats().get(key, 0)) if stats is not None else 0


def run_ckpt_part(cfg: dict[str, Any], root: Path) -> list[Row]:
    from elastic.checkpoint import write as _ckpt_write

    device = torch.device(cfg["device"])
    cuda = device.type == "cuda"
    rows: list[Row] = []

    def row(step: str, ok: bool | None, value: str, peak: Peak | None = None) -> None:
        status = INFO if ok is None else (OK if ok else WRONG)
        rows.append(Row("ckpt", step, status, value, peak.text() if peak is not None else ""))

    ckpt_bytes = cfg["ckpt_bytes"]
    free = shutil.disk_usage(root).free
    if free < 2.5 * ckpt_bytes:  # two checkpoints at once, or one and torch's file
        ckpt_bytes = int(free / 2.5 * 0.9)
        row("disk", None, f"only {free / GiB:.1f} GiB free under {root}: state reduced to fit")
    state = build(seed=7, device=device, model_bytes=ckpt_bytes // 3, count=cfg["tensors"], step=1)
    total = nbytes(tensors_of(state))
    row("state", None, f"{total / GiB:.3f} GiB in {len(tensors_of(state))} tensors on {device}")
    ckpts = root / "elastic"

    # A blocking save.
    blocking: list[float] = []
    _disk_sync()
    with Peak(device) as pk, timed(blocking):
        path = elastic.save(state, ckpts, keep=1)
    row(
        "save (blocking)",
        (path / "manifest.json").is_file(),
        f"{blocking[0]:.2f} s, {gbps(total, blocking[0])}",
        pk,
    )

    # Two async saves: how long each blocks, the staging reused; the state changes after the second.
    staged: list[list[int]] = []
    host_allocs: list[int] = []
    snapshot: list[torch.Tensor] = []
    for k in (1, 2):
        state.step += 1
        if k == 2:
            snapshot = [t.clone() for t in tensors_of(state)]
        _disk_sync()
        held: list[float] = []
        with Peak(device) as pk, timed(held):
            handle = elastic.save(state, ckpts, keep=1, blocking=False)
        returned = time.perf_counter()
        staging = list(_ckpt_write._staging)
        staged.append([t.data_ptr() for t in staging])
        if cuda:
            host_allocs.append(_host_stat("num_host_alloc"))
        if k == 2:  # the checkpoint must hold the values at save time, not these
            with torch.no_grad():
                for t in tensors_of(state):
                    if t.is_floating_point():
                        t.add_(1.0)
        written = handle.wait()
        durable = time.perf_counter() - returned
        row(
            f"save(blocking=False) #{k}: blocks the caller",
            (written / "manifest.json").is_file(),
            f"{held[0]:.3f} s ({held[0] / blocking[0]:.2f}x the blocking save); "
            f"durable {durable:.2f} s after it returned",
            pk,
        )
        if k == 1 and cuda:
            pinned = sum(1 for t in staging if t.is_pinned())
            row(
                "save(blocking=False): staging pinned",
                pinned == len(staging),
                f"{pinned}/{len(staging)} pinned",
            )
    row(
        "save(blocking=False): staging reused",
        len(staged[0]) == len(staged[1]) > 0 and staged[0] == staged[1],
        f"{sum(a == b for a, b in zip(*staged))}/{len(staged[1])} buffers the same",
    )

    if cuda:
        held_bytes = _host_stat("allocated_bytes.current")
        new_blocks = host_allocs[1] - host_allocs[0]
        row(
            "save(blocking=False): pinned host memory",
            None,
            f"{held_bytes / GiB:.2f} GiB held for {nbytes(staging) / GiB:.2f} GiB staged "
            f"(blocks rounded to powers of two); second save made {new_blocks} new blocks",
        )

    # torch.save / torch.load of the same state (torch.save plus fsync: elastic's save is durable).
    tfile = root / "torch.pt"
    t_save: list[float] = []
    _disk_sync()
    with Peak(device) as pk, timed(t_save):
        torch.save(
            {
                "model": state.model.state_dict(),
                "optimizer": state.optimizer.state_dict(),
                "step": state.step,
            },
            tfile,
        )
        with open(tfile, "rb") as f:
            os.fsync(f.fileno())
    row(
        "torch.save + fsync (baseline)",
        None,
        f"{t_save[0]:.2f} s; elastic blocking save {blocking[0] / t_save[0]:.2f}x",
        pk,
    )
    t_load: list[float] = []
    _disk_sync()
    _drop_cache(tfile)
    with Peak(device) as pk, timed(t_load):
        sd = torch.load(tfile, map_location=device, weights_only=True)
        state.model.load_state_dict(sd["model"])
        state.optimizer.load_state_dict(sd["optimizer"])
        del sd
    torch_load_peak = pk.extra
    row("torch.load + load_state_dict (baseline)", None, f"{t_load[0]:.2f} s", pk)
    tfile.unlink()

    # elastic.load in place into the existing CUDA tensors: the second async save's values come back.
    state.step = 0  # so that the checkpoint is more tenured than memory
    before = tensors_of(state)
    ptrs = [t.data_ptr() for t in before]
    params = list(state.model.parameters())
    e_load: list[float] = []
    _disk_sync()
    _drop_cache(ckpts)
    with Peak(device) as pk, timed(e_load):
        report = elastic.load(state, ckpts)
    if "load" in cfg["inject"]:
        corrupt(tensors_of(state)[0])
    row(
        "load: from the newest checkpoint",
        report.source == "checkpoint" and report.tenure == 3 and state.step == 3,
        f"{report.source}, tenure {report.tenure}; {e_load[0]:.2f} s "
        f"({e_load[0] / t_load[0]:.2f}x torch.load)",
        pk,
    )
    ok, text = in_place(state, ptrs, params)
    row("load: in place", ok, text)
    good, n = same_values(tensors_of(state), snapshot)
    row("load: values equal the async save's", good == n, f"{good}/{n} tensors bitwise equal")
    if cuda:
        bound = total // 8 + 64 * MiB
        row(
            "load: no GPU copy of the state",
            pk.extra <= bound,
            f"+{pk.extra / MiB:.0f} MiB (torch.load: +{torch_load_peak / MiB:.0f} MiB)",
        )
    return rows


# ---------------------------------------------------------------------------------------------------------
# Part 3: a world of one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """Launcher variables of a world of one for the block, restored after it.

    The default process group the block starts is destroyed at its end, also when the block raises.
    """
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_world1_part(cfg: dict[str, Any], root: Path) -> list[Row]:
    from elastic.replication.comm import Comm
    from elastic.replication.transport.broadcast import BroadcastTransport
    from elastic.state.tree import flatten

    device = torch.device(cfg["device"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    part = f"world1/{backend}"
    rows: list[Row] = []

    def row(step: str, ok: bool | None, value: str, peak: Peak | None = None) -> None:
        status = INFO if ok is None else (OK if ok else WRONG)
        rows.append(Row(part, step, status, value, peak.text() if peak is not None else ""))

    timeout = timedelta(seconds=cfg["timeout"])
    with world_of_one():
        with Peak(device) as pk:
            elastic.init_process_group(backend, timeout=timeout)
        row(f'init_process_group("{backend}")', dist.get_backend() == backend, dist.get_backend(), pk)
        # Eight weights of 3 MiB (broadcast on their own) and everything else through the buckets.
        state = build(seed=3, device=device, model_bytes=24 * MiB, count=16, step=5)
        with Peak(device) as pk:
            report = elastic.sync(state, timeout=timeout)
        row(
            "sync", report.world_size == 1 and report.tensor_bytes == 0, f"world_size {report.world_size}", pk
        )
        with Peak(device) as pk:
            elastic.verify(state, timeout=timeout)
        row("verify", True, "no error", pk)

        # The collectives a world of one never reaches through the public API, on the backend's device.
        comm = Comm(None, timeout, "gpu_check")
        small, large = b"elastic" * 10, os.urandom(100_000)  # one round, and two rounds of the all-gather
        with Peak(device) as pk:
            gathered = comm.all_gather_bytes(small, "check") + comm.all_gather_bytes(large, "check")
            sent = comm.broadcast_bytes(large, 0, "check")
        row(
            f"object payloads on {comm.device}",
            gathered == [small, large] and sent == large,
            "all_gather_bytes, broadcast_bytes round trip",
            pk,
        )
        flat = flatten(state, "sync")
        transport = BroadcastTransport()
        direct = transport.plan(flat.tensors, comm)
        errors: list[BaseException] = []
        before = [t.clone() for t in flat.tensors]
        with Peak(device) as pk:
            transport.send(comm, 0, flat.tensors, flat.metas, direct, errors.append)
        good, n = same_values(flat.tensors, before)
        row(
            "BroadcastTransport.send (source's half)",
            not errors and good == n,
            f"{sum(direct)} direct, {len(direct) - sum(direct)} bucketed; "
            + (f"error {errors[0]!r}" if errors else "source unchanged"),
            pk,
        )
        del before

        ckpts = root / "world1"
        with Peak(device) as pk:
            path = elastic.save(state, ckpts, timeout=timeout)
        row("save", (path / "manifest.json").is_file(), path.name, pk)
        snapshot = [t.clone() for t in tensors_of(state)]
        ptrs = [t.data_ptr() for t in tensors_of(state)]
        params = list(state.model.parameters())
        with torch.no_grad():
            for t in tensors_of(state):
                if t.is_floating_point():
                    t.mul_(-1.0)
        state.step = 0
        with Peak(device) as pk:
            loaded = elastic.load(state, ckpts, timeout=timeout)
        good, n = same_values(tensors_of(state), snapshot)
        kept, _ = in_place(state, ptrs, params)
        row(
            "load",
            loaded.source == "checkpoint" and state.step == 5 and good == n and kept,
            f"{loaded.source}, {good}/{n} equal, in place {kept}",
            pk,
        )
        state.step = 6
        with Peak(device) as pk:
            written = elastic.save(state, ckpts, blocking=False, timeout=timeout).wait()
        row("save(blocking=False)", (written / "manifest.json").is_file(), written.name, pk)
    return rows


# ---------------------------------------------------------------------------------------------------------
# Part 4: a sharded state (issue 20), saved in a world of one and loaded resharded on two CPU ranks


def build_sharded(seed: int, device_type: str) -> CheckState:
    """An FSDP2 state on a 1-D ``("shard",)`` mesh over the default group, after one Adam step.

    Its first layer shards unevenly (33 rows: pieces of 17 and 16 on two ranks); its BatchNorm's buffers
    stay plain tensors (FSDP2 shards parameters only), replicated on every rank.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("shard",))
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 33), torch.nn.BatchNorm1d(33), torch.nn.ReLU(), torch.nn.Linear(33, 8)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16, generator=g).to(mesh.device_type)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return CheckState(model, opt, step=0)


def full_state(state: CheckState) -> dict[str, Any]:
    """The whole state, gathered onto rank 0's CPU (empty dicts on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(state.model, options=options),
        "optimizer": get_optimizer_state_dict(state.model, state.optimizer, options=options),
        "step": state.step,
    }


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of nested dicts and lists, by their path (``optimizer.state.0.weight.exp_avg``)."""
    if isinstance(tree, dict):
        items: Iterator[tuple[Any, Any]] = iter(tree.items())
    elif isinstance(tree, list):
        items = enumerate(tree)
    else:
        return {prefix.rstrip("."): tree}
    return {k: v for key, sub in items for k, v in _leaves(sub, f"{prefix}{key}.").items()}


def _bitwise_equal(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return type(a) is type(b) and bool(a == b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


def compare(got: Any, want: Any) -> tuple[bool, str]:
    """Whether two trees have the same leaves, tensors bit for bit, and a line saying how many do."""
    a, b = _leaves(got), _leaves(want)
    keys = sorted(set(a) | set(b))
    bad = {k for k in keys if k not in a or k not in b or not _bitwise_equal(a[k], b[k])}
    tensors = [k for k in keys if isinstance(b.get(k), torch.Tensor)]
    others = [k for k in keys if k not in tensors]
    parts = [
        f"{sum(k not in bad for k in ks)}/{len(ks)} {what}"
        for ks, what in ((tensors, "tensors bit for bit"), (others, "other values equal"))
        if ks
    ]
    text = ", ".join(parts) + (f"; first differing: {min(bad)}" if bad else "")
    return not bad and bool(keys), text


def sharded_worker(ckpts: Path, inject: bool) -> dict[str, Any]:
    """Runs on each of the two CPU gloo ranks: the same model from another seed, then `load`."""
    from torch.distributed.tensor import DTensor

    state = build_sharded(seed=1, device_type="cpu")
    report = elastic.load(state, ckpts)
    weight = next(state.model.parameters())  # 0.weight
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, weight.to_local().shape[0] if isinstance(weight, DTensor) else None)
    full = full_state(state)
    if inject and dist.get_rank() == 0:
        corrupt(next(iter(full["model"].values())))
    return {
        "load_ok": (report.source, report.tenure, report.saved_world_size, report.world_size, state.step)
        == ("checkpoint", 1, 1, 2, 1),
        "load": f"{report.source}, tenure {report.tenure}, written by a world of {report.saved_world_size}, "
        f"step {state.step}",
        "pieces": pieces,
        "full": full,
    }


def run_sharded_part(cfg: dict[str, Any], root: Path) -> list[Row]:
    from torch.distributed.tensor import DTensor

    device = torch.device(cfg["device"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    rows: list[Row] = []

    def row(step: str, ok: bool | None, value: str, peak: Peak | None = None) -> None:
        status = INFO if ok is None else (OK if ok else WRONG)
        rows.append(Row("sharded", step, status, value, peak.text() if peak is not None else ""))

    timeout = timedelta(seconds=cfg["timeout"])
    ckpts = root / "sharded"
    with world_of_one():
        elastic.init_process_group(backend, timeout=timeout)
        with Peak(device) as pk:
            state = build_sharded(seed=0, device_type=device.type)
            state.step = 1
        params = list(state.model.parameters())
        sharded = [p for p in params if isinstance(p, DTensor)]
        meshes = {
            (p.device_mesh.device_type, p.device_mesh.shape, p.device_mesh.mesh_dim_names) for p in sharded
        }
        row(
            f"world of one ({backend}): FSDP2 state",
            len(sharded) == len(params) > 0 and meshes == {(device.type, (1,), ("shard",))},
            f"{len(sharded)}/{len(params)} parameters DTensors on mesh(es) {sorted(meshes)}",
            pk,
        )
        before = full_state(state)
        with Peak(device) as pk:
            report = elastic.sync(state, timeout=timeout)
        row(
            f"world of one ({backend}): sync moves nothing",
            report.world_size == 1 and report.tensor_bytes == 0 and report.object_bytes == 0,
            f"world_size {report.world_size}, tensor_bytes {report.tensor_bytes}, "
            f"object_bytes {report.object_bytes}",
            pk,
        )
        with Peak(device) as pk:
            path = Path(elastic.save(state, ckpts, timeout=timeout))
        files = sorted(f.name for f in path.iterdir())
        row(
            f"world of one ({backend}): save (DCP format)",
            {"manifest.json", ".metadata", "__0_0.distcp"} <= set(files),
            f"{path.name}: {', '.join(files)}",
            pk,
        )
        saved = full_state(state)
        ok, text = compare(saved, before)
        row(f"world of one ({backend}): sync and save leave the state", ok, text)
        del state, params, sharded  # the group's tensors go with the group

    per_rank = elastic.spawn(
        sharded_worker,
        nprocs=2,
        args=(ckpts, "sharded" in cfg["inject"]),
        backend="gloo",
        timeout=cfg["timeout"] * 2,
    )
    row(
        "2 CPU gloo ranks, mesh (2,): load",
        all(r["load_ok"] for r in per_rank),
        merged([r["load"] for r in per_rank]),
    )
    pieces = per_rank[0]["pieces"]
    row(
        "2 CPU gloo ranks: resharded into two pieces",
        pieces == [17, 16],
        f"0.weight (33 rows): {' + '.join(map(str, pieces))} rows",
    )
    got, want = per_rank[0]["full"], saved
    for name, a, b in (
        ("model", got["model"], want["model"]),
        ("optimizer state", got["optimizer"]["state"], want["optimizer"]["state"]),
        ("optimizer param_groups", got["optimizer"]["param_groups"], want["optimizer"]["param_groups"]),
    ):
        ok, text = compare(a, b)
        row(f"2 CPU gloo ranks: {name} as saved", ok, text)
    return rows


# ---------------------------------------------------------------------------------------------------------
# Driver


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (from /proc/mounts), or "?"."""
    best, kind = "", "?"
    with contextlib.suppress(OSError):
        real = str(path.resolve())
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and real.startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    return kind


def print_table(rows: list[Row]) -> None:
    widths = [max(len(h), *(len(getattr(r, a)) for r in rows)) for h, a in HEADERS]
    widths[3] = min(widths[3], 100)
    line = "  ".join(h.ljust(w) for (h, _), w in zip(HEADERS, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(getattr(r, a).ljust(w) for (_, a), w in zip(HEADERS, widths)).rstrip())


HEADERS = (
    ("part", "part"),
    ("step", "step"),
    ("status", "status"),
    ("value", "value"),
    ("peak GPU MiB", "peak"),
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-gib", type=float, default=None, help="sync model size (default 1; 1/64 on CPU)")
    p.add_argument(
        "--ckpt-gib", type=float, default=None, help="checkpoint state size (default 8; 1/32 on CPU)"
    )
    p.add_argument("--tensors", type=int, default=None, help="parameters per model (default 500; 64 on CPU)")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds of the sync part (default 3)")
    p.add_argument("--dir", type=Path, default=None, help="directory on the local disk (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for each collective (default 240)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    p.add_argument("--cpu", action="store_true", help="run the CPU analogue even where CUDA is available")
    p.add_argument(
        "--inject-wrong", default="", help=argparse.SUPPRESS
    )  # "sync,load,sharded": checks the check
    args = p.parse_args(argv)
    unknown = set(filter(None, args.parts.split(","))) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    why = "--cpu given" if args.cpu else "torch.cuda.is_available() is False"
    device = "cuda:0" if cuda else "cpu"
    model_gib = args.model_gib if args.model_gib is not None else (1.0 if cuda else 1 / 64)
    ckpt_gib = args.ckpt_gib if args.ckpt_gib is not None else (8.0 if cuda else 1 / 32)
    count = args.tensors if args.tensors is not None else (500 if cuda else 64)
    parts = [p for p in PARTS if p in args.parts.split(",")]
    cfg = {
        "device": device,
        "model_bytes": int(model_gib * GiB),
        "ckpt_bytes": int(ckpt_gib * GiB),
        "tensors": count,
        "rounds": max(1, args.rounds),
        "timeout": args.timeout,
        "inject": set(filter(None, args.inject_wrong.split(","))),
    }
    made = args.dir is None
    root = Path(tempfile.mkdtemp(prefix="gpu_check-")) if made else args.dir / f"gpu_check-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)

    gpu = torch.cuda.get_device_name(0) if cuda else f"none ({why})"
    print(f"elastic {elastic.__version__} from {Path(elastic.__file__).parent}; torch {torch.__version__}")
    print(f"GPU: {gpu}; states on {device}; checkpoints in {root} ({fs_type(root)})")
    print(
        f"sizes: sync model {model_gib:g} GiB, checkpoint state {ckpt_gib:g} GiB, "
        f"{count} parameters per model"
    )
    sys.stdout.flush()

    rows: list[Row] = []
    if not cuda:
        rows.append(Row("cuda", "states on cuda:0", SKIPPED, f"{why}: every part runs on CPU states"))
        rows.append(Row("cuda", "peak GPU memory", SKIPPED, why))
    runners: dict[str, Callable[[], list[Row]]] = {
        "sync": lambda: run_sync_part(cfg),
        "ckpt": lambda: run_ckpt_part(cfg, root),
        "world1": lambda: run_world1_part(cfg, root),
        "sharded": lambda: run_sharded_part(cfg, root),
    }
    started = time.perf_counter()
    try:
        for name in parts:
            t0 = time.perf_counter()
            try:
                found = runners[name]()
                rows.extend(found)
                for r in found:  # as they come, so that a run stopped later still shows them
                    print(
                        f"gpu_check: {r.part}: {r.step}: {r.status} {r.value} {r.peak}".rstrip(), flush=True
                    )
            except Exception as exc:
                traceback.print_exc()
                text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                rows.append(Row(name, "part failed", ERROR, f"{type(exc).__name__}: {text}"[:200]))
            rows.append(Row(name, "part done", INFO, f"{time.perf_counter() - t0:.1f} s"))
            if name == "sync":
                rows.append(
                    Row(
                        "sync",
                        "two ranks under NCCL",
                        SKIPPED,
                        "one GPU: NCCL refuses two ranks on one device",
                    )
                )
            if name == "ckpt" and not cuda:
                rows.append(Row("ckpt", "pinned staging", SKIPPED, f"{why}: CPU staging is not pinned"))
                rows.append(Row("ckpt", "load: no GPU copy of the state", SKIPPED, why))
            if name == "world1" and not cuda:
                rows.append(Row("world1", "NCCL world of one", SKIPPED, f"{why}: ran under gloo instead"))
            if name == "sharded" and not cuda:
                rows.append(Row("sharded", "NCCL world of one", SKIPPED, f"{why}: ran under gloo instead"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    bad = [r for r in rows if r.status in (WRONG, ERROR)]
    print()
    print_table(rows)
    print()
    total = time.perf_counter() - started
    if bad:
        print(
            f"gpu_check: {len(bad)} WRONG or ERROR row(s) in {total:.0f} s: {', '.join(r.step for r in bad)}"
        )
        return 1
    print(f"gpu_check: every value right ({sum(r.status == OK for r in rows)} checks) in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
