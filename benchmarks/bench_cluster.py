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
  first step with the others is reported too);
- ``loss``: every host drops 3 % of the packets it sends (iptables' ``statistic`` match), for `--window`
  seconds; the costs are the steady step before and during it (median and mean: a lost packet holds a
  step for a retransmission), and the regroups it caused (none wanted);
  the baseline, measured in the same run under the same fault: the toy's step with plain
  ``torch.distributed`` (its two all-reduces, the flag of `World.check` and the toy's own, and its sleep)
  on the same hosts, no elastic;
- ``delay``: every host delays the packets it sends by 40 +- 20 ms (uniform, so they may leave out of
  order; benchmarks/nfq_delay.c behind an NFQUEUE rule, compiled here: this kernel has no netem), the
  same figures.

Run (as root): ``PYTHONPATH=src python benchmarks/bench_cluster.py --runs 3``.
"""

from __future__ import annotations

import argparse
import functools
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
WINDOW = 20.0  # seconds of loss or delay
DELAY = ("40", "20")  # ms: mean, jitter
LOSS = "0.03"


@functools.cache
def _delayer() -> str:
    exe = Path(tempfile.mkdtemp(prefix="bench-cluster-nfq-")) / "nfq_delay"
    src = Path(__file__).with_name("nfq_delay.c")
    cc = ["cc", "-O2", "-o", str(exe), str(src), "-lnetfilter_queue", "-lnfnetlink"]
    built = subprocess.run(cc, capture_output=True, text=True)
    if built.returncode != 0:
        why = built.stderr.strip()
        msg = f"bench_cluster: cannot build {src.name} ({why}); apt-get install libnetfilter-queue-dev"
        raise SystemExit(msg)
    return str(exe)


def _degrade(hosts: Hosts, fault: str, loss: str = LOSS) -> list[Any]:
    """Every host's outgoing packets lost or delayed; returns the delaying processes."""
    procs = []
    for ns in hosts.names:
        rule = ["ip", "netns", "exec", ns, "iptables", "-A", "OUTPUT", "-o", "eth0"]
        if fault == "loss":
            rule += ["-m", "statistic", "--mode", "random", "--probability", loss, "-j", "DROP"]
        else:
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, _delayer(), "0", *DELAY]))
            rule += ["-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"]
        subprocess.run(rule, check=True, capture_output=True)
    time.sleep(0.2)  # the delayers bound to their queues (until then --queue-bypass lets packets through)
    return procs


def _restore(hosts: Hosts, procs: list[Any]) -> None:
    for ns in hosts.names:
        flush = ["ip", "netns", "exec", ns, "iptables", "-F", "OUTPUT"]
        subprocess.run(flush, check=True, capture_output=True)
    for proc in procs:
        proc.kill()
        proc.wait()


def _lines(out: Path, host: str) -> list[dict[str, Any]]:
    path = out / f"{host}.jsonl"
    if not path.exists():
        return []
    lines = (json.loads(x) for x in path.read_text().splitlines() if x.strip())
    return [r for r in lines if "step" in r and "t" in r]


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


def _plain(rank: int, addr: str, out: str) -> None:
    """A worker of the baseline: the toy's step (cluster_worker.py) with plain torch.distributed."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    client = dist.TCPStore(addr, PORT, None, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("plain", client), rank=rank, world_size=3)
    flag, g = torch.zeros(1, dtype=torch.int32), torch.zeros(4)
    with (Path(out) / f"p{rank}.jsonl").open("a", buffering=1) as lines:
        for step in itertools.count(1):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # World.check's flag
            g.fill_(float(step))
            dist.all_reduce(g)
            lines.write(json.dumps({"g": 0, "size": 3, "step": step, "t": time.time()}) + "\n")
            time.sleep(0.05)


def _steps(lines: list[dict[str, Any]], start: float, end: float, mean: bool = False) -> float:
    """The median (`mean`: the mean) time between two steps that both ended in [start, end)."""
    times = [r["t"] for r in lines if start <= r["t"] < end]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.mean(gaps) if mean else statistics.median(gaps)


def _degraded(
    hosts: Hosts, fault: str, out: Path, workers: list[Any], rdzv: str, window: float, loss: str
) -> dict[str, float]:
    """Loss or delay for `window` seconds under elastic.run, then for half as long under plain gloo."""
    at = time.time()
    procs = _degrade(hosts, fault, loss)
    time.sleep(window)
    _restore(hosts, procs)
    lines = {k: _lines(out, f"w{k}") for k in range(3)}
    gens = {r["g"] for k in range(3) for r in lines[k] if at < r["t"] < at + window + 1}
    result = {
        "steady_step_s": _steps(lines[0], 0.0, at),
        "step_during_s": _steps(lines[0], at + 1, at + window),
        "mean_step_during_s": _steps(lines[0], at + 1, at + window, mean=True),
        "regroups": float(len(gens) - 1),
    }
    for proc in workers:
        proc.kill()
        proc.wait()
    addr = rdzv.split(":")[0]
    argv = [sys.executable, __file__, "--plain"]
    plain = [hosts.popen(k, [*argv, str(k), addr, str(out)], stderr=subprocess.DEVNULL) for k in range(3)]
    _until(lambda: all(len(_lines(out, f"p{k}")) >= 10 for k in range(3)), 120)
    at = time.time()
    procs = _degrade(hosts, fault, loss)
    time.sleep(window / 2)
    _restore(hosts, procs)
    result["plain_steady_step_s"] = _steps(_lines(out, "p0"), 0.0, at)
    result["plain_step_during_s"] = _steps(_lines(out, "p0"), at + 1, at + window / 2)
    result["plain_mean_step_during_s"] = _steps(_lines(out, "p0"), at + 1, at + window / 2, mean=True)
    result["ratio_during"] = result["step_during_s"] / result["plain_step_during_s"]
    result["mean_ratio_during"] = result["mean_step_during_s"] / result["plain_mean_step_during_s"]
    for proc in plain:
        proc.kill()
    return result


def one(fault: str, window: float = WINDOW, loss: str = LOSS) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix=f"bench-cluster-{fault}-"))
    plans = {"store": "2,3,2", "loss": "3,2,3,2,3,2,3,2,3", "delay": "3,2,3,2,3,2,3,2,3"}
    env = {"ELASTIC_TEST_PLAN": plans.get(fault, "3,2,3")}  # loss, delay: train on whatever happens
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
        elif fault in ("loss", "delay"):
            pass  # _degraded below
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
        elif fault in ("loss", "delay"):
            result = _degraded(hosts, fault, out, workers, rdzv, window, loss)
        else:
            _until(lambda: any(r["size"] == 3 for r in _lines(out, "w2")), 120)
            times = [r["t"] for r in _lines(out, "w0")]
            around = [t for t in times if at - 5 < t < at + 5]
            result["members_pause_s"] = max(b - a for a, b in itertools.pairwise(around))
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
    parser.add_argument("--faults", default="death,cut,store,loss,delay")
    parser.add_argument("--window", type=float, default=WINDOW, help="seconds of loss or delay")
    parser.add_argument("--loss", default=LOSS, help="the share of packets each host drops (loss)")
    parser.add_argument("--plain", nargs=3, metavar=("RANK", "ADDR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:
        _plain(int(args.plain[0]), args.plain[1], args.plain[2])
        return
    reason = why_not()
    if reason:
        raise SystemExit(f"bench_cluster: {reason}")
    for fault in args.faults.split(","):
        runs = [one(fault, args.window, args.loss) for _ in range(args.runs)]
        for key in runs[0]:
            values = sorted(r[key] for r in runs)
            unit = "" if key in ("regroups", "ratio_during", "mean_ratio_during") else " s"
            mid = statistics.median(values)
            summary = f"median {mid:.3f}{unit}, range {values[0]:.3f}-{values[-1]:.3f}{unit}"
            sys.stdout.write(f"{fault:6s} {key:22s} {summary} over {len(values)} runs\n")


if __name__ == "__main__":
    main()
