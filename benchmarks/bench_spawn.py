"""How long does `elastic.spawn` take to run a trivial function, against `torch.multiprocessing.spawn`?

Time from the call to the results for a module-level function that does nothing, on 2 workers (the
default; ``--nprocs`` to change). The two launchers run interleaved, round by round, alternating which
goes first; the table reports the medians over rounds and their ratio (target: at most 1.5x).

What each one does in that time:

- ``torch.multiprocessing.spawn(fn, nprocs=N)``: N interpreters started by multiprocessing's "spawn"
  method; each imports this script (and so torch) as ``__mp_main__``, calls ``fn(i)`` and exits.
- ``elastic.spawn(fn, N)``: torch's elastic launcher with one agent (c10d rendezvous on a free loopback
  port, output tee'd to the caller's streams with ``[rank N]`` prefixes); N interpreters that import
  elastic (and so torch), read the cloudpickled function, initialise a gloo process group, call ``fn()``,
  write the result, destroy the group and exit; then the results are read back in rank order.

Both pay for starting N interpreters that import torch, which dominates on a small machine.

Run: ``python benchmarks/bench_spawn.py [--rounds 7] [--nprocs 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.multiprocessing as mp

import elastic


def trivial(*_: object) -> int:
    return 1


def time_elastic(nprocs: int) -> float:
    start = time.perf_counter()
    results = elastic.spawn(trivial, nprocs)
    elapsed = time.perf_counter() - start
    if results != [1] * nprocs:
        msg = f"elastic.spawn returned {results!r}"
        raise RuntimeError(msg)
    return elapsed


def time_torch(nprocs: int) -> float:
    start = time.perf_counter()
    mp.spawn(trivial, nprocs=nprocs, join=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--nprocs", type=int, default=2)
    opts = parser.parse_args()

    time_elastic(opts.nprocs)  # warm the page cache for both (untimed)
    time_torch(opts.nprocs)
    runs: dict[str, list[float]] = {"elastic.spawn": [], "torch.multiprocessing.spawn": []}
    for round_ in range(opts.rounds):
        order = [("elastic.spawn", time_elastic), ("torch.multiprocessing.spawn", time_torch)]
        if round_ % 2:
            order.reverse()
        for name, fn in order:
            runs[name].append(fn(opts.nprocs))

    medians = {name: statistics.median(times) for name, times in runs.items()}
    print(f"trivial function on {opts.nprocs} workers, {opts.rounds} interleaved rounds (seconds)")
    print(f"{'launcher':<30}{'median':>9}{'min':>9}{'max':>9}")
    for name, times in runs.items():
        print(f"{name:<30}{medians[name]:>9.2f}{min(times):>9.2f}{max(times):>9.2f}")
    ratio = medians["elastic.spawn"] / medians["torch.multiprocessing.spawn"]
    print(f"ratio elastic.spawn / torch.multiprocessing.spawn: {ratio:.2f}x (target <= 1.5x)")


if __name__ == "__main__":  # torch.multiprocessing.spawn's workers import this file again
    main()
