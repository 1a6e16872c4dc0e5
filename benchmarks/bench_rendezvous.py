"""The round protocol alone: seconds from a SIGKILL to the survivors' next generation.

3 worker processes on a served store run elastic's `Rendezvous` (no process groups, no training). The
benchmark kills one at random, tells the survivors at once (standing in for the collective that fails
at once under gloo), and times until every survivor holds the next generation; then a replacement
starts and joins at the survivors' next `pending()` check, timed from its `join()` call. Run:

    PYTHONPATH=src python benchmarks/bench_rendezvous.py --kills 10
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import statistics
import time
from datetime import timedelta
from typing import Any

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
