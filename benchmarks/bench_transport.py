"""How fast do the transports move a module's tensors, alone and inside `elastic.sync`?

Two gloo ranks on this machine; rank 0 holds a 2,000-parameter `nn.Module` (fp32 `Linear` layers, 128 MiB
by default), rank 1 a module of the same shapes, so every transfer writes in place. For each method, in the
same run and interleaved round by round (the order rotates), it times:

- floor: one `dist.broadcast` of a flat, preallocated buffer of the same bytes;
- `BroadcastTransport`, `SharedMemoryTransport` and `CrossMemoryTransport` (the default) `send`/`receive`
  alone (metadata and plans computed once, before the rounds);
- `elastic.sync(state, force=True)` with each of them as the default transport.

A round's time is the slower rank's, from a barrier to the end of the call; each method is printed as the
ratio of its median to the floor's median, with the CPU time both ranks spent (all threads).

    python benchmarks/bench_transport.py                  # 128 MiB, 7 rounds
    python benchmarks/bench_transport.py --mib 16 --rounds 3
    python benchmarks/bench_transport.py --shm 16:2,4:4     # compare shared-memory configurations
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_sync import ModuleState, free_port, layers_for  # the same state as bench_sync's module case

import elastic
from elastic.replication.comm import Comm
from elastic.replication.transport import default as _transports
from elastic.replication.transport.broadcast import BroadcastTransport
from elastic.replication.transport.cma import CrossMemoryTransport
from elastic.replication.transport.protocol import Transport
from elastic.replication.transport.shm import SharedMemoryTransport
from elastic.state.tensors import TensorMeta

MiB = 2**20


def label(key: str) -> str:
    name, _, tag = key.partition(" ")
    return {
        "floor": "one `broadcast` of a flat buffer (floor)",
        "broadcast": "`BroadcastTransport` send/receive",
        "shm": f"`SharedMemoryTransport` send/receive ({tag})",
        "cma": "`CrossMemoryTransport` send/receive",
        "sync_broadcast": "`elastic.sync(force=True)`, BroadcastTransport",
        "sync_shm": f"`elastic.sync(force=True)`, SharedMemoryTransport ({tag})",
        "sync_cma": "`elastic.sync(force=True)`, CrossMemoryTransport",
    }[name]


def make_methods(
    rank: int, state: ModuleState, flat: torch.Tensor, shms: dict[str, SharedMemoryTransport]
) -> dict[str, Callable[[], None]]:
    comm = Comm(None, timedelta(seconds=120), "bench")
    tensors = [p.data for p in state.model.parameters()]
    metas = [TensorMeta(("t", i), tuple(t.shape), t.dtype, "cpu") for i, t in enumerate(tensors)]
    errors: list[BaseException] = []
    bcast = BroadcastTransport()

    def transfer(transport: Transport) -> Callable[[], None]:
        box = [transport.plan(tensors, comm) if rank == 0 else None]
        dist.broadcast_object_list(box, 0)  # the source's plan, as sync sends it in its payload
        plan = box[0]

        def run() -> None:
            if rank == 0:
                transport.send(comm, 0, tensors, metas, plan, errors.append)
            else:
                transport.receive(comm, 0, tensors, metas, plan, errors.append)
            if errors:
                raise errors[0]

        return run

    def synced(transport: Transport) -> Callable[[], None]:
        def run() -> None:
            previous = _transports.set_default_transport(transport)
            try:
                report = elastic.sync(state, force=True)
            finally:
                _transports.set_default_transport(previous)
            if report.src != 0 or report.tensor_bytes != flat.numel():
                msg = f"unexpected sync report {report}"
                raise RuntimeError(msg)

        return run

    methods: dict[str, Callable[[], None]] = {
        "floor": lambda: dist.broadcast(flat, 0),
        "broadcast": transfer(bcast),
        "sync_broadcast": synced(bcast),
    }
    for tag, shm in shms.items():
        methods[f"shm {tag}"] = transfer(shm)
        methods[f"sync_shm {tag}"] = synced(shm)
    methods["cma"] = transfer(CrossMemoryTransport())
    methods["sync_cma"] = synced(CrossMemoryTransport())
    return methods


def time_one(fn: Callable[[], None]) -> tuple[float, float]:
    """(seconds of the slower rank, CPU seconds of both ranks)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    mine = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return max(float(r[0]) for r in rows), sum(float(r[1]) for r in rows)


def worker(rank: int, port: int, mib: int, count: int, rounds: int, configs: list[tuple[int, int]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    try:
        gen = torch.Generator().manual_seed(1234)
        k = layers_for(mib * MiB, count)
        model = torch.nn.Sequential(*(torch.nn.Linear(k, k) for _ in range(count // 2)))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) if rank == 0 else torch.zeros(p.shape))
        state = ModuleState(step=1 if rank == 0 else 0, model=model)
        total = sum(p.numel() * 4 for p in model.parameters())
        flat = torch.ones(total, dtype=torch.uint8)  # touched: no page faults inside the floor
        ids = [p.data_ptr() for p in model.parameters()]
        shms = {f"{b / MiB:g} MiB x {n}": SharedMemoryTransport(bucket_bytes=b, slots=n) for b, n in configs}
        methods = make_methods(rank, state, flat, shms)
        order = list(methods)
        times: dict[str, list[float]] = {m: [] for m in order}
        cpus: dict[str, list[float]] = {m: [] for m in order}
        for r in range(rounds + 1):  # round 0 warms up (connections, buffers, segment, mappings)
            for key in order[r % len(order) :] + order[: r % len(order)]:
                seconds, cpu = time_one(methods[key])
                if r > 0:
                    times[key].append(seconds)
                    cpus[key].append(cpu)
        if rank == 1:  # every method wrote the source's values in place
            gen = torch.Generator().manual_seed(1234)
            ref = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
            params = list(model.parameters())
            if [p.data_ptr() for p in params] != ids or not all(
                torch.equal(a, b) for a, b in zip(params, ref)
            ):
                msg = "receiver's parameters are not the source's values written in place"
                raise RuntimeError(msg)
        if rank == 0:
            report(times, cpus, total, count, rounds)
    finally:
        dist.destroy_process_group()


def report(
    times: dict[str, list[float]],
    cpus: dict[str, list[float]],
    total: int,
    count: int,
    rounds: int,
) -> None:
    floor = statistics.median(times["floor"])
    print(
        f"\n2 gloo ranks, torch {torch.__version__}, {os.cpu_count()} CPUs (load {os.getloadavg()[0]:.1f}), "
        f"{total / MiB:.0f} MiB in a module of {count:,} tensors (shared memory: bucket size x slots); "
        f"medians of {rounds} interleaved rounds\n"
    )
    print("| method | median ms | x floor | CPU ms, both ranks |")
    print("|---|---:|---:|---:|")
    for key, ts in times.items():
        ms = statistics.median(ts) * 1e3
        cpu = statistics.median(cpus[key]) * 1e3
        print(f"| {label(key)} | {ms:.1f} | {statistics.median(ts) / floor:.2f} | {cpu:.0f} |")
    print()
    for key in [k for k in times if k.startswith("shm ")]:
        tag = key.partition(" ")[2]
        alone = statistics.median(times[key]) / statistics.median(times["broadcast"])
        sync = statistics.median(times[f"sync_shm {tag}"]) / statistics.median(times["sync_broadcast"])
        print(f"shared memory ({tag}) / broadcast: transport alone {alone:.2f}x, inside sync {sync:.2f}x")
    alone = statistics.median(times["cma"]) / statistics.median(times["broadcast"])
    sync = statistics.median(times["sync_cma"]) / statistics.median(times["sync_broadcast"])
    print(f"cross memory / broadcast: transport alone {alone:.2f}x, inside sync {sync:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="state size in MiB (default 128)")
    parser.add_argument("--count", type=int, default=2000, help="parameters in the module (default 2000)")
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds (default 7)")
    parser.add_argument(
        "--shm",
        default="",
        help="comma-separated shared-memory configurations BUCKET_MIB:SLOTS (default: the defaults)",
    )
    args = parser.parse_args()
    default = SharedMemoryTransport()
    configs = [(default.bucket_bytes, default.slots)]
    if args.shm:
        configs = [(int(float(b) * MiB), int(n)) for b, n in (c.split(":") for c in args.shm.split(","))]
    mp.spawn(
        worker,
        args=(free_port(), args.mib, args.count, args.rounds, configs),
        nprocs=2,
        join=True,
    )


if __name__ == "__main__":
    main()
