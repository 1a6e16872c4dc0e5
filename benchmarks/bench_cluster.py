"""What each fault costs on separate hosts: the figures of docs/cluster.md's fault table.

Simulated hosts as in the tests (tests/netns.py: a network and a pid namespace per host behind a bridge,
gloo bound to each host's interface, the store on a host of its own; root only). Three worker hosts train
tests/recovery/cluster_worker.py's toy replicated state under `elastic.run` (``timeout=30``); each step
writes a timestamped line. Each fault is repeated `--runs` times; the cost is the time from the fault to
the survivors' first step in the next generation (median and range):

- ``death``: host 2's worker is killed (SIGKILL);
- ``cut``: host 2 is unplugged (a silent cut: nothing is reset);
- ``store``: the store is killed and a new, empty one started at its address; the cost is the longest
  pause of the members' steps across it, and a newcomer started right after it joins (its join to its
  first step with the others is reported too).

Run (as root): ``PYTHONPATH=src python benchmarks/bench_cluster.py --runs 3``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from netns import Hosts, why_not  # noqa: E402

WORKER = ROOT / "tests" / "recovery" / "cluster_worker.py"
PORT = 29433
TIMEOUT = "30"


def _lines(out: Path, host: str) -> list[dict[str, Any]]:
    path = out / f"{host}.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip() and '"step"' in x]


def _until(ok: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ok():
        if time.monotonic() > deadline:
            msg = "the run did not get there in time"
            raise TimeoutError(msg)
        time.sleep(0.05)


def _start(hosts: Hosts, k: int, rdzv: str, out: Path, env: dict[str, str]) -> Any:
    argv = [sys.executable, str(WORKER), rdzv, str(out), TIMEOUT]
    log = (out / f"w{k}.log").open("a")
    return hosts.popen(
        k, argv, env={**env, "ELASTIC_TEST_HOST": f"w{k}"}, stdout=log, stderr=subprocess.STDOUT
    )


def one(fault: str) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix=f"bench-cluster-{fault}-"))
    env = {"ELASTIC_TEST_PLAN": "3,2,3"} if fault != "store" else {"ELASTIC_TEST_PLAN": "2,3,2"}
    if fault == "store":
        env.update(ELASTIC_TEST_FIRST="2", ELASTIC_TEST_MIN="1")
    with Hosts(4) as hosts:
        serve = [sys.executable, "-m", "elastic.store", "--port", str(PORT)]
        store = hosts.popen(3, serve, stderr=subprocess.DEVNULL)
        rdzv = f"{hosts.address(3)}:{PORT}"
        first = 2 if fault == "store" else 3
        workers = [_start(hosts, k, rdzv, out, env) for k in range(first)]
        size = first
        _until(
            lambda: all(sum(r["size"] == size for r in _lines(out, f"w{k}")) >= 10 for k in range(first)), 180
        )
        at = time.time()
        if fault == "death":
            workers[2].kill()
        elif fault == "cut":
            hosts.cut(2)
        else:
            store.kill()
            store.wait()
            store = hosts.popen(3, serve, stderr=subprocess.DEVNULL)
            at = time.time()
            workers.append(_start(hosts, 2, rdzv, out, env))
        result: dict[str, float] = {}
        if fault in ("death", "cut"):

            def regrouped() -> bool:
                return all(any(r["size"] == 2 and r["t"] > at for r in _lines(out, f"w{k}")) for k in (0, 1))

            _until(regrouped, 60)
            result["cost_s"] = (
                max(
                    min(r["t"] for r in _lines(out, f"w{k}") if r["size"] == 2 and r["t"] > at)
                    for k in (0, 1)
                )
                - at
            )
            if fault == "cut":
                hosts.heal(2)
                healed = time.time()
                _until(lambda: any(r["size"] == 3 and r["t"] > healed for r in _lines(out, "w2")), 60)
                result["rejoin_s"] = (
                    min(r["t"] for r in _lines(out, "w2") if r["size"] == 3 and r["t"] > healed) - healed
                )
        else:
            _until(lambda: any(r["size"] == 3 for r in _lines(out, "w2")), 120)
            times = [r["t"] for r in _lines(out, "w0")]
            window = [t for t in times if at - 5 < t < at + 5]
            result["members_pause_s"] = max(b - a for a, b in itertools.pairwise(window))
            result["newcomer_first_step_s"] = min(r["t"] for r in _lines(out, "w2")) - at
            steady = [b - a for a, b in itertools.pairwise(times) if b < at - 0.2]
            result["steady_step_s"] = statistics.median(steady)
        for p in workers:
            p.kill()
        store.kill()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", default="death,cut,store")
    args = parser.parse_args()
    reason = why_not()
    if reason:
        raise SystemExit(f"bench_cluster: {reason}")
    for fault in args.faults.split(","):
        runs = [one(fault) for _ in range(args.runs)]
        for key in runs[0]:
            values = sorted(r[key] for r in runs)
            summary = f"median {statistics.median(values):.2f} s, range {values[0]:.2f}-{values[-1]:.2f} s"
            sys.stdout.write(f"{fault:6s} {key:22s} {summary} over {len(values)} runs\n")


if __name__ == "__main__":
    main()
