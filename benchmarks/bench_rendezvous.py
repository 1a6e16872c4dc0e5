"""The round protocol alone: its latency after a failure, and its store traffic at scale.

Two modes, both on elastic's `Rendezvous` alone (no process groups, no training):

``--kills K`` (the default mode): seconds from a SIGKILL to the survivors' next generation. 3 worker
processes on a store served in this process run the protocol; the benchmark kills one at random, tells
the survivors at once (standing in for the collective that fails at once under gloo), and times until
every survivor holds the next generation; then a replacement starts and joins at the survivors' next
`pending()` check, timed from its `join()` call. Run:

    PYTHONPATH=src python benchmarks/bench_rendezvous.py --kills 10

``--participants 8,64,512 --json FILE``: how the protocol scales with the number of participants. Each N
runs in a process of its own (so that a phase capped by its deadline leaves nothing behind), with the
store served by a child process ``python -m elastic.store`` (its server thread then shares no GIL with the
participants). The N participants are threads, spread over simulated hosts: processes of up to
``--per-host`` (64) participants each, as a cluster's hosts run several workers (8 at N=512; 1 at N<=64).
Each thread has its own TCPStore client connection wrapped in a counting `torch.distributed.Store`
(`CountingStore`: ops, keys read, bytes read); the heartbeat thread of each `Rendezvous` clones that
wrapper (``self._base.clone()``), so its traffic is counted too. Liveness is judged as across hosts: each
host process replaces ``elastic.recovery.rendezvous.process_space`` by one that returns ``""``, so no
participant learns a peer's pid and only heartbeats tell who is gone. Phases, for each N:

- formation: all N call `join()` at once (``min_workers=1, first_workers=N, max_workers=N``: the first
  round closes once all N are ready and its quiet last call passed); seconds until every one holds
  generation 0;
- steady state: 1 s to settle, then a 3 s window (``--steady``) in which all train and nothing happens:
  store ops/s and keys read/s over all participants' clients;
- regroup: participant N//2 (never rank 0) stops beating (its `close()` stops its heartbeat thread); the
  others run a stand-in training loop: every 20 ms (a short step) each host's driver thread calls its
  participants' `progress()` and checks their `pending()`; as `world.check()` exchanges the flags (one
  all-reduce), every survivor on every host calls `join()` once any survivor's `pending()` turned True
  (the hosts share the flag: one integer in shared memory). Seconds from the `close()` until every
  survivor holds one generation of exactly the N-1 survivors, and the ops and bytes read over that
  window, per survivor (the mean and the max). The notes give when the first flag was raised
  (``flagged_s``: the heartbeat expiry plus the monitor's period) and when the survivors' `join()`
  calls began (``join_began_s``) and returned (``joined_s``), first..median..last.

Rendezvous parameters: ``timeout=10 s`` (heartbeat period 0.1 s, expiry 0.6 s, grace 3 s, last call 1 s),
``join_timeout=600 s``; each phase is capped by ``--deadline`` seconds (default 300): a capped phase is
recorded with what it reached (the key ``incomplete``) and the later phases are skipped. The JSON is
``{"<N>": {"formation_s", "regroup_s", "ops_per_participant", "bytes_per_participant", "ops_max",
"bytes_max", "steady_ops_per_s", "steady_keys_per_s"}}``; the table printed with it also gives the
ratios against the protocol's targets (per-participant ops and bytes of a regroup within 2x from the
smallest N to the largest, steady keys read/s <= 20*N, regroup <= 1 s at 512). Run:

    PYTHONPATH=src python benchmarks/bench_rendezvous.py --participants 8,64,512 --json rdzv.json

Connections are made before the phases (the heartbeat's `clone()` hands out a client connected in
advance), 32 at a time, with ``RES_OPTIONS=timeout:1 attempts:1``: torch's TCPStore client looks up the
host name of every address it connects to, and where reverse DNS is slow (here, for
``::ffff:127.0.0.1``) a lookup stalled a connect() 5 s until one failed. The table's notes give the
CPU the host processes and the store process used in the steady and regroup windows (of this machine's
cores). Each host process runs with ``sys.setswitchinterval(0.05)`` (``--switch``): a thread waiting for
the GIL wakes every interval, and ~1000 of them in one process at CPython's default 5 ms spent more time
in the kernel than in Python here. (Before the hosts, all N threads ran in one process: at N=512 its GIL,
not the protocol, set the regroup's time.)

Counted per call: ``get`` 1 key, ``multi_get``/``check``/``wait`` one per key, ``compare_set`` 1,
``add`` of 0 (a read of a counter) 1; ``add`` of anything else (a heartbeat, an event's number) is a
write: an op, no key read, like ``set`` and ``append``. Bytes read: the returned values' lengths (``add``
of 0: 8, the int64 on the wire; ``check``: 1). Counting every heartbeat's ``add`` as a read too adds N
keys per period (10 N/s) to the steady figure. All participants share this machine's cores and one
GIL: at large N the numbers measure the protocol's demand only as far as the benchmark process keeps up
with it (see the table's notes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch.distributed as dist

TIMEOUT = timedelta(seconds=10)


def _worker(port: int, name: str, failed: Any, out: Any) -> None:
    import logging

    if os.environ.get("BENCH_DEBUG"):
        logging.basicConfig(level=logging.DEBUG, format=f"%(created).3f {name} %(message)s")
    from elastic.recovery.rendezvous import Rendezvous
    from elastic.recovery.store import connect

    store = connect("127.0.0.1", port, timeout=TIMEOUT)
    rdzv = Rendezvous(
        store, "bench", name, join_timeout=timedelta(seconds=60), timeout=TIMEOUT, address=f"127.0.0.1:{port}"
    )
    began = time.time()
    membership = rdzv.join()
    out.put((name, "joined", began, time.time(), membership))
    seen_failure = failed.value
    while membership is not None:
        rdzv.progress()
        if failed.value != seen_failure or rdzv.pending():
            seen_failure = failed.value
            began = time.time()
            membership = rdzv.join()
            out.put((name, "joined", began, time.time(), membership))
        time.sleep(0.001)


def kills_main(args: argparse.Namespace) -> None:

    from elastic.recovery.store import serve

    server = serve("127.0.0.1", 0, timeout=TIMEOUT)
    ctx = mp.get_context("spawn")
    failed = ctx.Value("i", 0)
    out = ctx.Queue()
    rng = random.Random(args.seed)
    count = 0

    def launch() -> Any:
        nonlocal count
        process = ctx.Process(target=_worker, args=(server.port, f"w{count}", failed, out), daemon=True)
        count += 1
        process.start()
        return process

    procs = {f"w{i}": launch() for i in range(args.workers)}
    generation = {}
    for _ in range(args.workers):
        name, _, _, _, m = out.get(timeout=60)
        generation[name] = m.generation
    regroup, admit = [], []
    for _ in range(args.kills):
        time.sleep(rng.uniform(0.3, 1.0))
        victim = rng.choice(sorted(procs))
        killed_at = time.time()
        os.kill(procs.pop(victim).pid, signal.SIGKILL)
        with failed.get_lock():
            failed.value += 1
        done: dict[str, Any] = {}
        while len(done) < len(procs):
            name, _, _, at, m = out.get(timeout=60)
            done[name] = (at, m)
        gens = {m.generation for _, m in done.values()}
        sizes = {m.size for _, m in done.values()}
        assert len(gens) == 1 and sizes == {len(procs)}, (gens, sizes)
        regroup.append(max(at for at, _ in done.values()) - killed_at)
        new = launch()
        procs[f"w{count - 1}"] = new
        done = {}
        began = None
        while len(done) < len(procs):
            name, _, start, at, m = out.get(timeout=60)
            done[name] = (at, m)
            if name == f"w{count - 1}":
                began = start
        assert began is not None
        admit.append(max(at for at, _ in done.values()) - began)
    for process in procs.values():
        process.kill()
    print(f"{args.workers} workers, {args.kills} SIGKILLs")
    print(
        f"kill -> survivors' next generation: median {statistics.median(regroup):.3f} s, "
        f"max {max(regroup):.3f} s"
    )
    print(
        f"replacement's join() -> generation with it: median {statistics.median(admit):.3f} s, "
        f"max {max(admit):.3f} s"
    )


# ------------------------------------------------------------------------------------- the scale mode

JOIN_TIMEOUT = timedelta(seconds=600)
LOOP = 0.02  # the stand-in training loop: progress() and pending() every 20 ms (a short training step)
SETTLE = 1.0
STACK = 2 << 20  # ~1000 threads: 2 MiB stacks instead of the default 8 MiB
# A thread waiting for the GIL wakes every switch interval (CPython's default 5 ms): ~1000 threads at 5 ms
# spent 9.5 min of system time (futex, under gVisor) in a 5.5 min run at N=512 (43 s at 50 ms)
SWITCH = 0.05
PER_HOST = 64


class Counts:
    """One store client's traffic: operations, keys read, bytes read (updated by one thread only)."""

    __slots__ = ("bytes", "keys", "ops")

    def __init__(self) -> None:
        self.ops = 0
        self.keys = 0
        self.bytes = 0


class CountingStore(dist.Store):
    """A store that counts the traffic of the store it wraps; `clone` wraps the base's clone (or one of
    `spares`, clients connected in advance) and registers it with `on_clone` (a participant's heartbeat
    thread clones its store).

    Every method the rendezvous may call is here. torch's C++ trampoline for Python stores, which a
    `PrefixStore` around this one goes through, calls ``deleteKey`` and ``getNumKeys`` (aliases below)
    and has no queue or list_keys support (those overrides serve direct calls only); a PrefixStore's
    set_timeout sets its own timeout, not this one's. Ops: the store operations issued (a clone is none).
    """

    def __init__(
        self,
        base: dist.Store,
        counts: Counts,
        on_clone: Callable[[CountingStore], None],
        spares: list[dist.Store] | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.counts = counts
        self._on_clone = on_clone
        self._spares = spares if spares is not None else []

    def _read(self, keys: int, nbytes: int) -> None:
        c = self.counts
        c.ops += 1
        c.keys += keys
        c.bytes += nbytes

    def set(self, key: str, value: Any) -> None:
        self.counts.ops += 1
        self.base.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.base.get(key)
        self._read(1, len(value))
        return value

    def add(self, key: str, value: int) -> int:
        out = self.base.add(key, value)
        if value == 0:  # a read of a counter
            self._read(1, 8)
        else:  # an increment (a heartbeat, an event's number): a write, counted with the ops
            self.counts.ops += 1
        return out

    def append(self, key: str, value: Any) -> None:
        self.counts.ops += 1
        self.base.append(key, value)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        out = self.base.compare_set(key, expected_value, desired_value)
        self._read(1, len(out))
        return out

    def check(self, keys: list[str]) -> bool:
        out = self.base.check(keys)
        self._read(len(keys), 1)
        return out

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out = self.base.multi_get(keys)
        self._read(len(keys), sum(len(v) for v in out))
        return out

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.counts.ops += 1
        self.base.multi_set(keys, values)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.base.wait(keys)
        else:
            self.base.wait(keys, timeout)
        self._read(len(keys), 0)

    def delete_key(self, key: str) -> bool:
        self.counts.ops += 1
        return self.base.delete_key(key)

    deleteKey = delete_key  # the name torch's trampoline calls

    def num_keys(self) -> int:
        self._read(0, 8)
        return self.base.num_keys()

    getNumKeys = num_keys  # the name torch's trampoline calls

    def queue_push(self, key: str, value: Any) -> None:
        self.counts.ops += 1
        self.base.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        out = self.base.queue_pop(key, block)
        self._read(1, len(out))
        return out

    def queue_len(self, key: str) -> int:
        self._read(1, 8)
        return self.base.queue_len(key)

    def list_keys(self) -> list[str]:
        out = self.base.list_keys()
        self._read(len(out), sum(len(k) for k in out))
        return out

    def has_extended_api(self) -> bool:
        return self.base.has_extended_api()

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.base.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self.base.timeout

    def clone(self) -> CountingStore:
        base = self._spares.pop() if self._spares else self.base.clone()
        twin = CountingStore(base, Counts(), self._on_clone, self._spares)
        self._on_clone(twin)
        return twin


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


def _serve_child() -> tuple[subprocess.Popen[str], int]:
    """``python -m elastic.store`` on a free port of 127.0.0.1; the process and its port."""
    import elastic

    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(elastic.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH", "")) if x)
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic.store", "--host", "127.0.0.1", "--port", "0"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "serving the rendezvous store at" in line:
            port = int(line.split(" at ", 1)[1].split()[0].rpartition(":")[2])
            threading.Thread(target=_drain, args=(proc.stderr,), daemon=True).start()
            return proc, port
    msg = f"python -m elastic.store exited ({proc.wait()}) without serving"
    raise RuntimeError(msg)


class _Participant:
    def __init__(self, index: int, n: int, port: int) -> None:
        from elastic.recovery.rendezvous import Rendezvous
        from elastic.recovery.store import connect

        self.name = f"{index}.bench"
        self.stores: list[CountingStore] = []  # keeps every wrapper (the heartbeat's clone too) alive
        # the heartbeat's clone() gets a client connected now, so that formation times no connect()
        spare = connect("127.0.0.1", port, timeout=TIMEOUT)
        base = connect("127.0.0.1", port, timeout=TIMEOUT)
        store = CountingStore(base, Counts(), self.stores.append, [spare])
        self.stores.append(store)
        self.rdzv = Rendezvous(
            store,
            f"scale{n}",
            self.name,
            min_workers=1,
            first_workers=n,
            max_workers=n,
            join_timeout=JOIN_TIMEOUT,
            timeout=TIMEOUT,
            address=f"127.0.0.1:{port}",
        )
        self.wake = threading.Event()
        self.busy = True  # in join(): the driver leaves it alone
        self.trigger = ""
        self.quit = False
        self.membership: Any = None
        self.error: BaseException | None = None

    def totals(self) -> tuple[int, int, int]:
        stores = list(self.stores)
        return (
            sum(s.counts.ops for s in stores),
            sum(s.counts.keys for s in stores),
            sum(s.counts.bytes for s in stores),
        )


def _one(n: int, args: argparse.Namespace) -> None:
    """One N, in this process: formation, steady state, regroup; the result goes to ``args.result``."""
    server, port = _serve_child()
    try:
        result = _phases(n, args, port, server.pid)
        with open(args.result, "w") as f:
            json.dump(result, f)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        server.terminate()
        server.wait(timeout=30)
        os._exit(0)


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _host(
    h: int,
    indices: list[int],
    n: int,
    port: int,
    args: argparse.Namespace,
    conn: Any,
    go: Any,
    leave: Any,
    flagged_at: Any,
) -> None:
    """One simulated host: the participants `indices` as threads, and their stand-in training loop.

    Talks to the coordinator over `conn`: reports ``("ready",)`` once connected, ``("held", phase, gen,
    at, totals, triggers)`` each time its participants of `phase`'s names all hold one generation newer
    than the phase's floor whose members are exactly those names; answers ``("mark",)`` with its totals,
    ``("phase", k, names, after)`` (the next phase), ``("kill", name)`` (that participant stops beating),
    ``("act",)`` (the driver's triggers now make participants join) and ``("stop",)``. `go` starts every
    participant's first join at once; `leave` is the generation every host's members leave (world.check's
    exchange of the flags across hosts: a shared integer, -1 none)."""
    import elastic.recovery.rendezvous as rz

    rz.process_space = lambda: ""  # judged as across hosts: no peer's pid, heartbeats alone
    import logging

    if os.environ.get("RDZV_TRACE"):
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
    threading.stack_size(STACK)
    sys.setswitchinterval(args.switch)
    send_lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(msg)

    with ThreadPoolExecutor(min(len(indices), 32)) as pool:
        parts = list(pool.map(lambda i: _Participant(i, n, port), indices))
    lock = threading.Lock()
    state: dict[str, Any] = {"phase": 0, "names": {p.name for p in parts}, "after": -1, "reported": -2}
    state["names"] = {f"{i}.bench" for i in range(n)}
    triggers: dict[str, int] = {}
    local = {p.name: p for p in parts}
    dead: set[str] = set()
    times: list[tuple[float, float]] = []

    def held() -> None:  # under the lock, after a join returned
        names, after = state["names"], state["after"]
        mine = [p for p in parts if p.name in names]
        ms = [p.membership for p in mine]
        if any(m is None or m.generation <= after for m in ms):
            return
        gens = {m.generation for m in ms}
        if len(gens) != 1 or (ms and set(ms[0].members) != names):
            return
        g = gens.pop() if ms else after + 1
        if state["reported"] == (state["phase"], g):
            return
        state["reported"] = (state["phase"], g)
        totals = {p.name: p.totals() for p in mine}
        send(("held", state["phase"], g, time.monotonic(), totals, dict(triggers)))

    def life(p: _Participant) -> None:
        go.wait()
        while not p.quit:
            try:
                began = time.monotonic()
                m = p.rdzv.join()
                times.append((began, time.monotonic()))
            except BaseException as exc:  # reported by the coordinator
                p.error = exc
                send(("error", p.name, repr(exc)))
                return
            with lock:
                p.membership = m
                p.busy = False
                held()
            p.wake.wait()
            p.wake.clear()

    acting = threading.Event()
    stop = threading.Event()
    seen_pending: set[str] = set()

    def drive() -> None:
        while not stop.is_set():
            live = [p for p in parts if p.name not in dead]
            flagged = set()
            for p in live:
                if p.busy:
                    continue
                p.rdzv.progress()
                if p.rdzv.pending():
                    flagged.add(p.rdzv.generation)
                    if not acting.is_set():
                        seen_pending.add(p.name)
            if acting.is_set():
                for g in flagged:  # this host's flag, exchanged with every host's (world.check())
                    with leave.get_lock():
                        if g > leave.value:
                            leave.value = g
                            flagged_at.value = time.monotonic()
                g = leave.value
                for p in live:
                    if p.busy or p.rdzv.generation != g or g < 0:
                        continue
                    trigger = "pending" if g in flagged and p.rdzv.pending() else "check"
                    p.busy, p.trigger = True, trigger
                    triggers[trigger] = triggers.get(trigger, 0) + 1
                    p.wake.set()
            time.sleep(LOOP)

    threads = [threading.Thread(target=life, args=(p,), daemon=True, name=p.name) for p in parts]
    for t in threads:
        t.start()
    threading.Thread(target=drive, daemon=True, name="driver").start()
    send(("ready",))
    while True:
        msg = conn.recv()
        if msg[0] == "mark":
            send(("totals", time.monotonic(), {p.name: p.totals() for p in parts}, len(seen_pending)))
        elif msg[0] == "phase":
            with lock:
                state["phase"], state["names"], state["after"] = msg[1], set(msg[2]), msg[3]
                triggers.clear()
        elif msg[0] == "kill":
            victim = local[msg[1]]
            dead.add(victim.name)
            at = time.monotonic()
            victim.rdzv.close()
            send(("killed", at))
        elif msg[0] == "act":
            times.clear()
            acting.set()
        elif msg[0] == "times":
            send(("times", list(times)))
        elif msg[0] == "stop":
            stop.set()
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the heartbeats would report the store's end
            os._exit(0)


def _phases(n: int, args: argparse.Namespace, port: int, store_pid: int) -> dict[str, Any]:
    def say(text: str) -> None:
        print(f"[N={n} {time.monotonic() - t_start:7.2f} s] {text}", file=sys.stderr, flush=True)

    t_start = time.monotonic()
    ctx = mp.get_context("spawn")
    per_host = max(1, args.per_host)
    hosts = [list(range(k, min(n, k + per_host))) for k in range(0, n, per_host)]
    go, leave, flagged_at = ctx.Event(), ctx.Value("i", -1), ctx.Value("d", 0.0)
    conns, procs = [], []
    for h, indices in enumerate(hosts):
        parent, child = ctx.Pipe()
        shared = (go, leave, flagged_at)
        proc = ctx.Process(target=_host, args=(h, indices, n, port, args, child, *shared), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    errors: list[str] = []

    def recv(c: Any, kind: str, deadline: float) -> tuple[Any, ...] | None:
        """The next message `kind` from host `c` (errors noted), or None at the deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not c.poll(left):
                return None
            msg = c.recv()
            if msg[0] == "error":
                errors.append(f"{msg[1]}: {msg[2]}")
            elif msg[0] == kind:
                return msg

    far = time.monotonic() + args.deadline
    for c in conns:
        if recv(c, "ready", far) is None:
            raise SystemExit(f"N={n}: a host did not connect its participants within {args.deadline:g} s")
    say(f"{n} participants connected, {len(hosts)} host process(es) of up to {per_host}")
    out: dict[str, Any] = dict.fromkeys(
        (
            "formation_s",
            "regroup_s",
            "ops_per_participant",
            "bytes_per_participant",
            "ops_max",
            "bytes_max",
            "steady_ops_per_s",
            "steady_keys_per_s",
        )
    )
    info: dict[str, Any] = {"hosts": len(hosts)}
    pids = [store_pid, *(p.pid for p in procs)]

    def windows() -> tuple[float, float, float]:
        return time.monotonic(), sum(_cpu(pid) for pid in pids[1:]), _cpu(store_pid)

    def load(a: tuple[float, float, float], b: tuple[float, float, float]) -> str:
        wall = b[0] - a[0]
        return f"bench {(b[1] - a[1]) / wall:.2f} + store {(b[2] - a[2]) / wall:.2f} cores"

    def await_phase(k: int, deadline: float) -> tuple[float, dict[str, tuple[int, int, int]], dict[str, int]]:
        """Every host's report for phase k at one generation: (the last one's time, totals, triggers)."""
        latest: dict[int, tuple[Any, ...]] = {}
        while True:
            gens = {m[2] for m in latest.values()}
            if len(latest) == len(conns) and len(gens) == 1:
                break
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(conns, timeout=max(left, 0)) if left > 0 else []
            if not ready:
                raise TimeoutError
            for c in ready:
                msg = c.recv()
                if msg[0] == "error":
                    errors.append(f"{msg[1]}: {msg[2]}")
                elif msg[0] == "held" and msg[1] == k:
                    h = conns.index(c)
                    if h not in latest or msg[2] >= latest[h][2]:
                        latest[h] = msg
        totals: dict[str, tuple[int, int, int]] = {}
        trig: dict[str, int] = {}
        for m in latest.values():
            totals.update(m[4])
            for key, v in m[5].items():
                trig[key] = trig.get(key, 0) + v
        return max(m[3] for m in latest.values()), totals, trig

    def mark() -> tuple[dict[str, tuple[int, int, int]], int]:
        totals: dict[str, tuple[int, int, int]] = {}
        pend = 0
        for c in conns:
            c.send(("mark",))
        for c in conns:
            msg = recv(c, "totals", time.monotonic() + 30)
            assert msg is not None
            totals.update(msg[2])
            pend += msg[3]
        return totals, pend

    try:
        t0 = time.monotonic()
        go.set()
        try:
            at, _, _ = await_phase(0, t0 + args.deadline)
        except TimeoutError:
            out["incomplete"] = f"formation: not every host held generation 0 of all {n} at the deadline"
            if errors:
                out["incomplete"] += f"; {len(errors)} join() raised, the first: {errors[0]}"
            say(out["incomplete"])
            return out | {"_info": info}
        out["formation_s"] = at - t0
        say(f"formation {out['formation_s']:.3f} s")

        time.sleep(SETTLE)
        c0 = windows()
        s0, _ = mark()
        time.sleep(args.steady)
        c1 = windows()
        s1, steady_pending = mark()
        info["cpu_steady"] = load(c0, c1)
        out["steady_ops_per_s"] = sum(s1[k][0] - s0[k][0] for k in s0) / (c1[0] - c0[0])
        out["steady_keys_per_s"] = sum(s1[k][1] - s0[k][1] for k in s0) / (c1[0] - c0[0])
        info["steady_pending"] = steady_pending
        say(f"steady {out['steady_ops_per_s']:.0f} ops/s, {out['steady_keys_per_s']:.0f} keys/s")
        if n == 1:
            return out | {"_info": info}

        victim = n // 2
        vname = f"{victim}.bench"
        survivors = sorted(f"{i}.bench" for i in range(n) if i != victim)
        for c in conns:
            c.send(("phase", 1, survivors, 0))
        before, _ = mark()
        host = next(h for h, indices in enumerate(hosts) if victim in indices)
        c0 = windows()
        conns[host].send(("kill", vname))
        killed = recv(conns[host], "killed", time.monotonic() + 30)
        assert killed is not None
        t0 = killed[1]
        print(f"T0 {t0:.4f}", file=sys.stderr, flush=True)
        for c in conns:
            c.send(("act",))
        try:
            at, after, trig = await_phase(1, t0 + args.deadline)
            out["regroup_s"] = at - t0
            info["flagged_s"] = round(flagged_at.value - t0, 3)
            info["generation"] = leave.value + 1
            say(f"regroup {out['regroup_s']:.3f} s (the first flag after {info['flagged_s']:.3f} s)")
        except TimeoutError:
            after, _ = mark()
            trig = {}
            out["incomplete"] = f"regroup: not every host held one generation of the {n - 1} at the deadline"
            say(out["incomplete"])
        info["cpu_regroup"] = load(c0, windows())
        starts, ends = [], []
        for c in conns:
            c.send(("times",))
            msg = recv(c, "times", time.monotonic() + 30)
            starts += [b - t0 for b, _ in (msg[1] if msg is not None else [])]
            ends += [e - t0 for _, e in (msg[1] if msg is not None else [])]
        if ends:  # when the survivors' join() calls began (their flag seen) and returned (the decision,
            # then the waiters waking)
            starts.sort()
            ends.sort()
            info["join_began_s"] = f"{starts[0]:.3f}..{starts[len(starts) // 2]:.3f}..{starts[-1]:.3f}"
            info["joined_s"] = f"{ends[0]:.3f}..{ends[len(ends) // 2]:.3f}..{ends[-1]:.3f}"
        ops = [after[k][0] - before[k][0] for k in survivors]
        nbytes = [after[k][2] - before[k][2] for k in survivors]
        out["ops_per_participant"] = sum(ops) / len(ops)
        out["bytes_per_participant"] = sum(nbytes) / len(nbytes)
        out["ops_max"] = max(ops)
        out["bytes_max"] = max(nbytes)
        info["triggers"] = trig
        if errors:
            info["errors"] = f"{len(errors)}, the first: {errors[0]}"
        return out | {"_info": info}
    finally:
        for c in conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(("stop",))
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def _ratio(value: float | None, target: float) -> str:
    return "-" if value is None else f"{value / target:.2f}"


def _fmt(value: Any, spec: str) -> str:
    width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
    return "-".rjust(width) if value is None else format(value, spec)


def _capped(value: float | None, spec: str, args: argparse.Namespace) -> str:
    """A phase's seconds, or ``>deadline`` where it was capped."""
    width = int(spec.split(".")[0])
    return f">{args.deadline:g}".rjust(width) if value is None else format(value, spec)


def _table(
    results: dict[str, dict[str, Any]], info: dict[str, dict[str, Any]], args: argparse.Namespace
) -> str:
    ns = sorted(results, key=int)
    base = results[ns[0]]
    rows = [
        "rendezvous at scale: threads as participants, one TCPStore client each (+ its heartbeat's clone), "
        "store served by a child `python -m elastic.store`; process_space patched to '' (liveness by "
        "heartbeat only, as across hosts)",
        f"timeout=10 s (period 0.1 s, expiry 0.6 s, grace 3 s), join_timeout=600 s, min_workers=1, "
        f"first_workers=max_workers=N; victim: participant N//2 (close()); loop {LOOP * 1000:g} ms; "
        f"{args.per_host} participants per host process; "
        f"steady: {SETTLE:g} s settle + {args.steady:g} s window; deadline {args.deadline:g} s a phase; "
        f"switch interval {args.switch * 1000:g} ms; connections made before the phases",
        "",
        f"{'N':>5} {'form_s':>8} {'regroup_s':>9} {'ops/p':>9} {'bytes/p':>11} {'ops_max':>8} "
        f"{'bytes_max':>11} {'st_ops/s':>10} {'st_keys/s':>11} | {'ops x':>6} {'bytes x':>7} "
        f"{'keys/20N':>8} {'rg/1s':>6} | {'run_s':>6}  triggers",
    ]
    for k in ns:
        r, i = results[k], info[k]
        ops_x = bytes_x = None
        if r["ops_per_participant"] is not None and base["ops_per_participant"]:
            ops_x = r["ops_per_participant"] / base["ops_per_participant"]
            bytes_x = r["bytes_per_participant"] / base["bytes_per_participant"]
        rows.append(
            f"{k:>5} {_capped(r['formation_s'], '8.3f', args)} {_capped(r['regroup_s'], '9.3f', args)} "
            f"{_fmt(r['ops_per_participant'], '9.0f')} {_fmt(r['bytes_per_participant'], '11.0f')} "
            f"{_fmt(r['ops_max'], '8d')} {_fmt(r['bytes_max'], '11d')} "
            f"{_fmt(r['steady_ops_per_s'], '10.0f')} "
            f"{_fmt(r['steady_keys_per_s'], '11.0f')} | {_fmt(ops_x, '6.2f')} {_fmt(bytes_x, '7.2f')} "
            f"{_ratio(r['steady_keys_per_s'], 20 * int(k)):>8} {_ratio(r['regroup_s'], 1.0):>6} | "
            f"{i.get('run_s', 0):6.1f}  {i.get('triggers', '-')}"
        )
    rows += [
        "",
        f"targets: ops x, bytes x = per-participant ops, bytes of the regroup / those at N={ns[0]} (<= 2); "
        "keys/20N = steady keys read/s / (20*N) (<= 1); rg/1s = regroup_s / 1 s (<= 1 at N=512)",
        "triggers: what made the survivors join (pending: its own pending() said so; check: another "
        "survivor's flag, exchanged as world.check() does); a capped phase (>deadline): ops and bytes over "
        "the deadline's window, not a regroup's",
    ]
    for k in ns:
        notes = [f"{key}={value}" for key, value in info[k].items() if key not in ("run_s", "triggers")]
        if "incomplete" in results[k]:
            notes.append(results[k]["incomplete"])
        rows.append(f"N={k}: " + ", ".join(notes))
    return "\n".join(rows)


def _env() -> dict[str, str]:
    """The environment of a run: torch's TCPStore client looks up the host name of every address it
    connects to (``getnameinfo``, for its log lines, pytorch#159007) and stops only once a lookup fails;
    where DNS answers slowly (here: ``::ffff:127.0.0.1`` is not in /etc/hosts, some reverse lookups took
    5 s) that stalls connections. A resolver timeout of 1 s, one attempt, makes the first slow one fail."""
    env = dict(os.environ)
    env.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    return env


def scale_main(args: argparse.Namespace) -> None:
    results: dict[str, dict[str, Any]] = {}
    info: dict[str, dict[str, Any]] = {}
    for n in (int(x) for x in args.participants.split(",")):
        with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", str(n), "--result", f.name]
            cmd += ["--steady", str(args.steady), "--deadline", str(args.deadline)]
            cmd += ["--switch", str(args.switch), "--per-host", str(args.per_host)]
            began = time.monotonic()
            rc = subprocess.run(cmd, check=False, env=_env()).returncode
            text = f.read()
        if rc != 0 or not text:
            msg = f"N={n}: the benchmark process exited with status {rc}"
            raise SystemExit(msg)
        result = json.loads(text)
        info[str(n)] = result.pop("_info") | {"run_s": time.monotonic() - began}
        results[str(n)] = result
        if args.json:  # written after each N: a later one that fails keeps the earlier ones
            with open(args.json, "w") as out:
                json.dump(results, out, indent=2)
    print(_table(results, info, args))


def _raise_limits() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--participants", help="the scale mode: comma-separated N, e.g. 8,64,512")
    parser.add_argument("--json", help="the scale mode's results, written to this file")
    parser.add_argument("--steady", type=float, default=3.0, help="seconds of the steady-state window")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds a phase may take at most")
    parser.add_argument(
        "--switch", type=float, default=SWITCH, help="the participants' process's sys.setswitchinterval"
    )
    parser.add_argument(
        "--per-host",
        type=int,
        default=PER_HOST,
        help="participants per simulated host: a process of its own, its participants threads in it",
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _raise_limits()
    if args.one is not None:
        _one(args.one, args)  # exits: threads still blocked in join() (a capped phase) must not hold it
    if args.participants:
        scale_main(args)
    else:
        kills_main(args)


if __name__ == "__main__":
    main()
