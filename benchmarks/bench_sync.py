"""How fast does `elastic.sync` move a state, against the plain torch.distributed ways to move it?

Two gloo ranks on this machine. Rank 0 holds the more tenured state, rank 1 a state of the same shapes,
so every sync writes in place; `force=True` makes every round move all the bytes. For each state, in the
same run and interleaved round by round (the order rotates), it times:

- floor: one `dist.broadcast` of a flat, preallocated buffer of the same bytes (no Python, no packing);
- `elastic.sync(state, force=True)`: election, object payload, tensors, commit; both ranks on one host,
  so the tensors go through the default transport's shared-memory ring;
- the same sync with the broadcast transport only (what ranks on different hosts get: gloo broadcasts of
  reused buckets, like the floor over loopback TCP);
- that transport's `send`/`receive` alone (plan made once, before the rounds): the path between hosts
  until this release, without the sync around it;
- the TCP transport's `send`/`receive` alone (the path between hosts now: connections of its own,
  `sendmsg` from the source's tensors, `recvmsg_into` the receiver's; planned before each round, outside
  the timing, since each plan opens its own listening socket: in a sync the plan rides the object
  payload), and the same sync with the TCP transport as the default (on one host sync would otherwise
  read the source's memory);
- one TCP socket between the ranks moving the tensors in place with `sendmsg`/`recvmsg_into` (scatter-
  gather, no packing): not something sync does, a reference for what a path without copies costs;
- one `dist.broadcast` per tensor (what a hand-written `sync()` does);
- `dist.broadcast_object_list` of the tensors (pickled);
- `torch.distributed._broadcast_coalesced`, torch's C++ bucketed broadcast that DDP uses to align
  replicas, with DDP's bucket size; and the same with torch's intra-op threads limited to 1 (as sync
  limits them), to show how much of the difference is thread contention on a small machine.

A round's time is the slower rank's, from a barrier to the end of the call. Each method is printed as the
ratio of its median to the floor's median (the floor alone flips between about 30 and 45 ms from one
round to the next here, so per-round ratios would be noisier), with the CPU time both ranks spent (all
threads: a figure that other load on the machine disturbs less than wall time). The receiver's peak
extra memory is the rise of its high-water mark (VmHWM, reset through /proc/self/clear_refs) above its RSS
before the call; for sync the memory its transport keeps between calls is added (the shared slots it maps,
or the bucket buffers of the broadcast transport), since it exists only for sync.

    python benchmarks/bench_sync.py            # 128 MiB states, 7 rounds
    python benchmarks/bench_sync.py --quick    # 16 MiB states, 3 rounds (smoke run)

Between two hosts (or network namespaces), one process per host, rank 0's address as the master:

    python benchmarks/bench_sync.py --rank 0 --master 10.9.0.1:29511 ...   # on the first host
    python benchmarks/bench_sync.py --rank 1 --master 10.9.0.1:29511 ...   # on the second

Or both ranks on two simulated hosts of this machine (root: two network namespaces behind a bridge, each
rank in its own pid namespace too, gloo bound to the namespace's interface; `tests/netns.py`):

    python benchmarks/bench_sync.py --netns --case module --methods transport,tcp,sg_socket,sync,sync_tcp
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import elastic
from elastic.replication.comm import Comm
from elastic.replication.transport import broadcast as _transport
from elastic.replication.transport import default as _transports
from elastic.replication.transport.broadcast import BroadcastTransport
from elastic.replication.transport.cma import CrossMemoryTransport
from elastic.replication.transport.shm import SharedMemoryTransport, shared_cached_bytes
from elastic.replication.transport.tcp import TcpTransport
from elastic.state.tensors import TensorMeta

MiB = 2**20
#: DDP's default `broadcast_bucket_size` for `_sync_module_states`.
DDP_BUCKET_BYTES = 250 * MiB
#: The transport ranks on different hosts get (the default's fallback).
BROADCAST = BroadcastTransport()
#: The transport ranks on different hosts get now (the shared-memory transport's fallback).
TCP = TcpTransport()


@elastic.elastic_state(tenure="step")
@attrs.define
class BenchState:
    step: int
    tensors: list[torch.Tensor]


@elastic.elastic_state(tenure="step")
@attrs.define
class ModuleState:
    """Where real scripts keep their tensors: in a module (walked through its state dict)."""

    step: int
    model: torch.nn.Module

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p.data for p in self.model.parameters()]


def layers_for(total_bytes: int, count: int) -> int:
    """The width `k` of `count // 2` fp32 `Linear(k, k)` layers holding at least `total_bytes`."""
    per_layer = -(-total_bytes // 4 // (count // 2))
    k = 1
    while k * k + k < per_layer:
        k += 1
    return k


def sizes_for(total_bytes: int, count: int) -> list[int]:
    """`count` fp32 element counts summing to `total_bytes` (the first ones one element larger)."""
    elems = total_bytes // 4
    base, extra = divmod(elems, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


# ---------------------------------------------------------------------------------------------------------
# Receiver memory from /proc (Linux)


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_high_water() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


_libc = ctypes.CDLL(None)


def trim_heap() -> None:
    """Give free heap pages back to the OS, so that reusing them shows in the high-water mark."""
    with contextlib.suppress(AttributeError):  # not glibc
        _libc.malloc_trim(0)


# ---------------------------------------------------------------------------------------------------------
# The methods


def connect_pair(rank: int) -> socket.socket:
    """A TCP connection between rank 0 (listening on MASTER_ADDR) and rank 1, for the `sg_socket` row."""
    if rank == 0:
        with socket.create_server((os.environ["MASTER_ADDR"], 0)) as server:
            port = torch.tensor([server.getsockname()[1]])
            dist.broadcast(port, 0)
            conn, _ = server.accept()
    else:
        port = torch.tensor([0])
        dist.broadcast(port, 0)
        conn = socket.create_connection((os.environ["MASTER_ADDR"], int(port)))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def move_in_place(conn: socket.socket, views: list[memoryview], send: bool) -> None:
    """Every byte of `views` over `conn`, `sendmsg`/`recvmsg_into` on up to 512 of them at a time."""
    for start in range(0, len(views), 512):
        batch = views[start : start + 512]
        while batch:
            n = conn.sendmsg(batch) if send else conn.recvmsg_into(batch)[0]
            if n == 0:
                msg = "the peer closed the connection"
                raise EOFError(msg)
            while batch and n >= len(batch[0]):
                n -= len(batch[0])
                batch = batch[1:]
            if n:
                batch = [batch[0][n:], *batch[1:]]
    if send:  # done when the receiver has everything
        conn.recv(1)
    else:
        conn.sendall(b"k")


def make_methods(
    state: BenchState | ModuleState, flat: torch.Tensor, rank: int, conn: socket.socket | None
) -> dict[str, Callable[[], None]]:
    world = dist.group.WORLD
    tensors = state.tensors
    comm = Comm(None, timedelta(seconds=120), "bench")
    metas = [TensorMeta(("t", i), tuple(t.shape), t.dtype, "cpu") for i, t in enumerate(tensors)]
    box = [BROADCAST.plan(tensors, comm) if rank == 0 else None]
    dist.broadcast_object_list(box, 0)  # the source's plan, as sync sends it in its payload
    plan = box[0]
    views = [t.numpy().data.cast("B") for t in tensors]

    def floor() -> None:
        dist.broadcast(flat, 0)

    def sync() -> None:
        report = elastic.sync(state, force=True)
        if report.src != 0 or report.tensor_bytes != flat.numel():
            msg = f"unexpected sync report {report}"
            raise RuntimeError(msg)

    def sync_broadcast() -> None:  # the same over gloo broadcasts only (what ranks on other hosts get)
        previous = _transports.set_default_transport(BROADCAST)
        try:
            sync()
        finally:
            _transports.set_default_transport(previous)

    def transport() -> None:  # the broadcast transport's send/receive alone
        errors: list[BaseException] = []
        if rank == 0:
            BROADCAST.send(comm, 0, tensors, metas, plan, errors.append)
        else:
            BROADCAST.receive(comm, 0, tensors, metas, plan, errors.append)
        if errors:
            raise errors[0]

    tcp_plan: list[object] = [None]

    def tcp_prepare() -> None:  # a fresh plan (listening socket, token) before each round, as each sync has
        box = [TCP.plan(tensors, comm) if rank == 0 else None]
        dist.broadcast_object_list(box, 0)
        tcp_plan[0] = box[0]

    def tcp() -> None:  # the TCP transport's send/receive alone
        errors: list[BaseException] = []
        plan = tcp_plan[0]
        if plan is None or getattr(plan, "address", None) is None:
            msg = f"the TCP transport planned its fallback alone: {plan!r:.200}"
            raise RuntimeError(msg)
        if rank == 0:
            TCP.send(comm, 0, tensors, metas, plan, errors.append)
        else:
            TCP.receive(comm, 0, tensors, metas, plan, errors.append)
        if errors:
            raise errors[0]

    tcp.prepare = tcp_prepare  # type: ignore[attr-defined]

    def sync_tcp() -> None:  # sync over the TCP transport (what ranks on other hosts get)
        previous = _transports.set_default_transport(TCP)
        try:
            sync()
        finally:
            _transports.set_default_transport(previous)

    def sg_socket() -> None:
        assert conn is not None
        move_in_place(conn, views, rank == 0)

    def verify() -> None:  # digests every byte of the state, one small all-gather
        elastic.verify(state)

    def fast_sync() -> None:  # nothing to move: replicas already identical (one small all-gather)
        report = elastic.sync(state)
        if report.tensor_bytes != 0:
            msg = f"expected the fast path, got {report}"
            raise RuntimeError(msg)

    def per_tensor() -> None:
        for t in state.tensors:
            dist.broadcast(t, 0)

    def object_list() -> None:
        objects: list[object] = [state.tensors if rank == 0 else None]
        dist.broadcast_object_list(objects, 0)

    def coalesced() -> None:
        dist._broadcast_coalesced(world, state.tensors, DDP_BUCKET_BYTES, 0)

    def coalesced16() -> None:  # the same with 16 MiB buckets
        dist._broadcast_coalesced(world, state.tensors, 16 * MiB, 0)

    def coalesced_1t() -> None:  # the same, with torch's intra-op pool limited as sync limits it
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            dist._broadcast_coalesced(world, state.tensors, DDP_BUCKET_BYTES, 0)
        finally:
            torch.set_num_threads(before)

    return {
        "floor": floor,
        "sync": sync,
        "sync_broadcast": sync_broadcast,
        "transport": transport,
        "tcp": tcp,
        "sync_tcp": sync_tcp,
        "sg_socket": sg_socket,
        "fast_sync": fast_sync,
        "verify": verify,
        "per_tensor": per_tensor,
        "object_list": object_list,
        "coalesced": coalesced,
        "coalesced16": coalesced16,
        "coalesced_1t": coalesced_1t,
    }


LABELS = {
    "floor": "one `broadcast` of a flat buffer (floor)",
    "sync": "`elastic.sync(state, force=True)`",
    "sync_broadcast": "`elastic.sync(state, force=True)`, broadcast transport (no shared memory)",
    "transport": "`BroadcastTransport` send/receive alone",
    "tcp": "`TcpTransport` send/receive alone",
    "sync_tcp": "`elastic.sync(state, force=True)`, TCP transport",
    "sg_socket": "one TCP socket, `sendmsg`/`recvmsg_into` of the tensors in place (reference)",
    "fast_sync": "`elastic.sync(state)` with nothing to move (fast path)",
    "verify": "`elastic.verify(state)` (digest of every byte)",
    "per_tensor": "one `broadcast` per tensor",
    "object_list": "`broadcast_object_list` of the tensors",
    "coalesced": "`_broadcast_coalesced` (DDP, 250 MiB buckets)",
    "coalesced16": "`_broadcast_coalesced`, 16 MiB buckets",
    "coalesced_1t": "`_broadcast_coalesced`, torch threads limited to 1",
}


def kept_by(key: str) -> float:
    """Bytes the method's transport keeps between calls on this rank (shared memory mapped or own, bucket
    buffers); 0 for the methods that keep nothing."""
    if key == "sync":
        return float(shared_cached_bytes())
    if key in ("sync_broadcast", "transport", "tcp", "sync_tcp"):
        return float(_transport.cached_bytes())
    return 0.0


def time_one(fn: Callable[[], None], key: str) -> tuple[float, float, float, float]:
    """(seconds of the slower rank, CPU seconds of both ranks (all threads), receiver's rise of its
    high-water mark, memory its transport keeps between calls)."""
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        prepare()
    gc.collect()
    trim_heap()
    reset_high_water()
    rss = status_kib("VmRSS")
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rise = (status_kib("VmHWM") - rss) * 1024.0
    kept = kept_by(key)
    mine = torch.tensor([seconds, cpu, rise, kept], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return (
        max(float(r[0]) for r in rows),
        sum(float(r[1]) for r in rows),
        float(rows[1][2]),
        float(rows[1][3]),
    )


def run_case(
    rank: int,
    name: str,
    total: int,
    count: int,
    rounds: int,
    methods_wanted: list[str],
    conn: socket.socket | None,
) -> dict:
    gen = torch.Generator().manual_seed(1234)
    make = (lambda n: torch.randn(n, generator=gen)) if rank == 0 else torch.zeros
    state: BenchState | ModuleState
    if name == "module":
        k = layers_for(total, count)
        model = torch.nn.Sequential(*(torch.nn.Linear(k, k) for _ in range(count // 2)))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(make(p.numel()).view_as(p))
        state = ModuleState(step=1 if rank == 0 else 0, model=model)
        sizes = [t.numel() for t in state.tensors]
        total = sum(sizes) * 4
    else:
        sizes = sizes_for(total, count)
        state = BenchState(step=1 if rank == 0 else 0, tensors=[make(n) for n in sizes])
    tensors = state.tensors
    flat = torch.ones(total, dtype=torch.uint8)  # touched: no page faults inside the floor
    ids = [t.data_ptr() for t in tensors]
    _transports.release_buffers()  # this case's sync allocates (and then keeps) its own
    methods = {k: v for k, v in make_methods(state, flat, rank, conn).items() if k in methods_wanted}
    order = list(methods)
    times: dict[str, list[float]] = {k: [] for k in order}
    cpus: dict[str, list[float]] = {k: [] for k in order}
    mem: dict[str, list[tuple[float, float]]] = {k: [] for k in order}
    elastic.sync(state, force=True)  # one lineage for the fast-path and verify rows
    for r in range(rounds + 1):  # round 0 warms up (connections, bucket buffers, allocator)
        turn = order[r % len(order) :] + order[: r % len(order)]
        for key in turn:
            seconds, cpu, rise, kept = time_one(methods[key], key)
            if r > 0:
                times[key].append(seconds)
                cpus[key].append(cpu)
                mem[key].append((rise, kept))
    # The sync wrote the source's values in place on the receiver.
    if rank == 1:
        ref = [torch.randn(n, generator=gen) for n in sizes]
        if [t.data_ptr() for t in state.tensors] != ids or not all(
            torch.equal(a.reshape(-1), b) for a, b in zip(state.tensors, ref)
        ):
            msg = "receiver's tensors are not the source's values written in place"
            raise RuntimeError(msg)
    return {"name": name, "total": total, "count": count, "times": times, "cpus": cpus, "mem": mem}


def worker(
    rank: int,
    master: tuple[str, int],
    cases: list[tuple[str, int, int]],
    rounds: int,
    methods: list[str],
    load: float,
) -> None:
    os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    conn = connect_pair(rank) if "sg_socket" in methods else None
    try:
        results = [run_case(rank, *case, rounds, methods, conn) for case in cases]
        if rank == 0:
            report(results, rounds, load)
    finally:
        if conn is not None:
            conn.close()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Report


def report(results: list[dict], rounds: int, load_before: float) -> None:
    default = _transports.default_transport()
    used = default.fallback if isinstance(default, CrossMemoryTransport) else default
    assert isinstance(used, SharedMemoryTransport)
    bucket = used.bucket_bytes
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(
        f"\n2 gloo ranks, torch {torch.__version__}, {os.cpu_count()} CPUs (load {load}); sync: "
        f"{type(default).__name__}, shared memory {used.slots} x {bucket / MiB:g} MiB slots, broadcast "
        f"transport {BROADCAST.in_flight} x "
        f"{BROADCAST.bucket_bytes / MiB:g} MiB buckets, direct_bytes {BROADCAST.direct_bytes / MiB:g} MiB; "
        f"medians of {rounds} interleaved rounds\n"
    )
    print("| state | method | median ms | x floor | CPU ms, both ranks | receiver peak extra MiB |")
    print("|---|---|---:|---:|---:|---:|")
    verdicts = []
    for res in results:
        times = res["times"]
        floor = times["floor"]
        where = "a module of" if res["name"] == "module" else "a list of"
        state = f"{res['total'] / MiB:.0f} MiB in {where} {res['count']:,} tensors"
        ratios = {}
        for key, ts in times.items():
            ratios[key] = statistics.median(ts) / statistics.median(floor)
            rise = statistics.median(r for r, _ in res["mem"][key]) / MiB
            kept = max(k for _, k in res["mem"][key]) / MiB
            mem = f"{rise + kept:.1f}"
            if key in ("sync", "sync_broadcast", "transport", "tcp", "sync_tcp"):
                mem += f" ({kept:g} kept + {rise:.1f})"
            cpu = statistics.median(res["cpus"][key]) * 1e3
            ms = statistics.median(ts) * 1e3
            print(f"| {state} | {LABELS[key]} | {ms:.1f} | {ratios[key]:.2f} | {cpu:.0f} | {mem} |")
        if "sync" in ratios:
            peak = max(r + k for r, k in res["mem"]["sync"]) / MiB
            line = f"{state}: sync {ratios['sync']:.2f}x floor"
            if "coalesced" in ratios:
                vs = statistics.median(times["sync"]) / statistics.median(times["coalesced"])
                line += f", {vs:.2f}x _broadcast_coalesced"
            if "coalesced16" in ratios:
                vs = statistics.median(times["sync"]) / statistics.median(times["coalesced16"])
                line += f", {vs:.2f}x _broadcast_coalesced at 16 MiB buckets"
            if "sync_broadcast" in ratios:
                line += f" ({ratios['sync_broadcast']:.2f}x by broadcasts only)"
            if "transport" in ratios:
                line += f", the broadcast transport alone {ratios['transport']:.2f}x"
            if "tcp" in ratios:
                line += f", the TCP transport alone {ratios['tcp']:.2f}x"
            if "sync_tcp" in ratios:
                line += f" (sync by it {ratios['sync_tcp']:.2f}x)"
            line += f", receiver peak extra memory (worst round) {peak:.1f} MiB"
            if "verify" in ratios:
                line += f"; verify costs {ratios['verify'] / ratios['sync']:.2f}x one sync"
            if "fast_sync" in ratios:
                line += f", a sync with nothing to move {ratios['fast_sync'] / ratios['sync']:.3f}x"
            verdicts.append(line)
    print()
    for line in verdicts:
        print(line)
    print("targets: many tensors <= 2.0x floor and <= 0.8x _broadcast_coalesced; few tensors <= 1.3x floor;")
    print("         a module of 2,000 tensors <= 2.0x floor and <= 0.8x 16 MiB-bucket _broadcast_coalesced;")
    print("         peak extra memory <= 2 buckets of 16 MiB (32 MiB);")
    print("         between hosts (the TCP transport alone), a module of 2,000 tensors <= 1.3x floor")


def run_on_namespaces(argv: list[str]) -> None:
    """This benchmark with rank k on simulated host k (`tests/netns.py`: a network and a pid namespace
    each, behind a bridge, gloo bound to the host's interface); rank 0 prints the table."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import netns

    why = netns.why_not()
    if why is not None:
        msg = f"--netns needs simulated hosts: {why}"
        raise SystemExit(msg)
    with netns.Hosts(2) as hosts:
        master = f"{hosts.address(0)}:29511"
        here = str(Path(__file__).resolve())
        procs = [
            hosts.popen(k, [sys.executable, here, "--rank", str(k), "--master", master, *argv])
            for k in (0, 1)
        ]
        codes = [proc.wait() for proc in procs]
    if any(codes):
        msg = f"the ranks on the simulated hosts exited with {codes}"
        raise SystemExit(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB states, 3 rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 7, quick 3)")
    parser.add_argument("--mib", type=int, default=None, help="state size in MiB (default 128, quick 16)")
    parser.add_argument(
        "--methods",
        default="floor,sync,sync_broadcast,sync_tcp,transport,tcp,sg_socket,fast_sync,verify,per_tensor,"
        "object_list,coalesced,coalesced16,coalesced_1t",
        help="comma-separated subset of the methods (floor is always kept): " + ",".join(LABELS),
    )
    parser.add_argument("--case", choices=["many", "few", "module", "both", "all"], default="all")
    parser.add_argument("--rank", type=int, default=None, help="run this rank only (one process per host)")
    parser.add_argument("--master", default=None, help="HOST:PORT of rank 0, with --rank")
    parser.add_argument(
        "--netns", action="store_true", help="run the two ranks on two simulated hosts (root; tests/netns.py)"
    )
    args = parser.parse_args()
    mib = args.mib or (16 if args.quick else 128)
    rounds = args.rounds or (3 if args.quick else 7)
    many = 250 if args.quick else 2000
    cases = []
    if args.case in ("many", "both", "all"):
        cases.append(("many", mib * MiB, many))
    if args.case in ("few", "both", "all"):
        cases.append(("few", mib * MiB, 16))
    if args.case in ("module", "all"):
        cases.append(("module", mib * MiB, many))
    methods = ["floor", *[m for m in args.methods.split(",") if m and m != "floor"]]
    unknown = set(methods) - set(LABELS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}")
    load = os.getloadavg()[0]
    if args.netns:
        run_on_namespaces([a for a in sys.argv[1:] if a != "--netns"])
        return
    if args.rank is not None:
        if args.master is None or args.rank not in (0, 1):
            parser.error("--rank 0 or 1 needs --master HOST:PORT")
        host, _, port = args.master.rpartition(":")
        worker(args.rank, (host, int(port)), cases, rounds, methods, load)
        return
    mp.spawn(worker, args=(("127.0.0.1", free_port()), cases, rounds, methods, load), nprocs=2, join=True)


if __name__ == "__main__":
    main()
