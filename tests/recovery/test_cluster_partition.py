"""`elastic.run` through an asymmetric partition on separate hosts (tests/netns.py): hosts 2 and 3 cannot
reach each other, silently, while every host reaches the store.

The cut: in host 2's network namespace host 3's address is bound to a MAC address nobody has (a
permanent neighbour entry), and the mirror in host 3, so their frames to each other are lost on the
bridge: no reset, no ICMP; a connect between them times out (checked). Four worker hosts (0-3) and a
store host (4); `partition_worker.py` trains a toy state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from netns import Hosts, why_not

HERE = Path(__file__).resolve().parent
REASON = why_not()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))

PORT = 29431
TIMEOUT = 6.0  # the collective timeout: a link gone silent during a step costs this much
NOBODY = "02:00:00:00:00:99"


def _lines(out: Path, host: str) -> list[dict[str, Any]]:
    path = out / f"{host}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(what: str, ok: Any, seconds: float, procs: list[Any], logs: list[Path]) -> float:
    """Poll `ok()` until it holds (returns when, monotonic); fail after `seconds` or if a worker failed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ok():
            return time.monotonic()
        if any(p.poll() not in (None, 0) for p in procs):
            text = "\n".join(log.read_text()[-3000:] for log in logs)
            pytest.fail(f"a worker exited while waiting for {what}:\n{text}")
        time.sleep(0.05)
    text = "\n".join(log.read_text()[-3000:] for log in logs)
    pytest.fail(f"{what}: not within {seconds} s:\n{text}")


def _cut(hosts: Hosts, a: int, b: int) -> None:
    for x, y in ((a, b), (b, a)):
        subprocess.run(
            [
                *("ip", "-n", hosts.names[x], "neigh", "replace", hosts.address(y), "lladdr", NOBODY),
                *("dev", "eth0", "nud", "permanent"),
            ],
            check=True,
        )


def _heal(hosts: Hosts, a: int, b: int) -> None:
    for x, y in ((a, b), (b, a)):
        cmd = ["ip", "-n", hosts.names[x], "neigh", "del", hosts.address(y), "dev", "eth0"]
        subprocess.run(cmd, check=True)


def _connect(hosts: Hosts, src: int, dst: int) -> str:
    """What a TCP connect from host `src` to a closed port of host `dst` gets within 1 s."""
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(({hosts.address(dst)!r}, 9), timeout=1)\n"
        "except TimeoutError: print('timeout')\n"
        "except ConnectionRefusedError: print('refused')\n"
        "except OSError as e: print(e)\n"
    )
    cmd = ["ip", "netns", "exec", hosts.names[src], sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()


def _start(hosts: Hosts, out: Path, join_timeout: float) -> tuple[Any, list[Any], list[Path]]:
    serve = [sys.executable, "-m", "elastic.store", "--port", str(PORT)]
    store = hosts.popen(4, serve, stderr=subprocess.DEVNULL)
    rdzv = f"{hosts.address(4)}:{PORT}"
    logs = [out / f"w{k}.log" for k in range(4)]
    worker = str(HERE / "partition_worker.py")
    argv = [sys.executable, worker, rdzv, str(out), str(TIMEOUT), str(join_timeout)]
    workers = [
        hosts.popen(
            k,
            argv,
            env={"ELASTIC_TEST_HOST": f"w{k}", "ELASTIC_SLOT": str(k)},  # the slot: ranks follow the hosts
            stdout=logs[k].open("w"),
            stderr=subprocess.STDOUT,
        )
        for k in range(4)
    ]
    return store, workers, logs


def _steps(out: Path, host: str, size: int, since: int = 0) -> list[dict[str, Any]]:
    return [r for r in _lines(out, host)[since:] if r.get("size") == size]


@pytest.mark.timeout(240)
def test_a_pair_that_goes_silent_leaves_the_largest_set_training_and_heals(tmp_path: Path) -> None:
    with Hosts(5) as hosts:
        store, workers, logs = _start(hosts, tmp_path, join_timeout=120)
        _wait(
            "the four training together",
            lambda: all(len(_steps(tmp_path, f"w{k}", 4)) >= 5 for k in range(4)),
            120,
            workers,
            logs,
        )
        before = [len(_lines(tmp_path, f"w{k}")) for k in range(4)]
        _cut(hosts, 2, 3)
        cut_at = time.monotonic()
        # silent: a connect between 2 and 3 times out (no reset), while 0 still gets refused by 3
        assert _connect(hosts, 2, 3) == "timeout"
        assert _connect(hosts, 3, 2) == "timeout"
        assert _connect(hosts, 0, 3) == "refused"

        def three_went_on() -> bool:
            return all(len(_steps(tmp_path, f"w{k}", 3, before[k])) >= 5 for k in (0, 1, 2))

        went_on = _wait("0, 1, 2 training without 3", three_went_on, TIMEOUT + 20, workers, logs)
        converged = went_on - cut_at
        gens = {r["g"] for k in (0, 1, 2) for r in _steps(tmp_path, f"w{k}", 3, before[k])}
        assert len(gens) == 1, gens  # one generation of three, the same on its members: no regroup loop
        excluded = _lines(tmp_path, "w3")[before[3] :]
        assert all(r.get("size") == 4 for r in excluded)  # 3 made no step in another generation
        time.sleep(2)  # 3 stays out while the cut lasts, and the three train on without regrouping
        assert {r["g"] for k in (0, 1, 2) for r in _steps(tmp_path, f"w{k}", 3, before[k])} == gens
        assert all(r.get("size") == 4 for r in _lines(tmp_path, "w3")[before[3] :])
        assert "left out" in logs[3].read_text()

        _heal(hosts, 2, 3)
        healed_at = time.monotonic()
        after = [len(_lines(tmp_path, f"w{k}")) for k in range(4)]
        rejoined = _wait(
            "the four training together again",
            lambda: all(len(_steps(tmp_path, f"w{k}", 4, after[k])) >= 5 for k in range(4)),
            60,
            workers,
            logs,
        )
        (tmp_path / "stop").write_text("4")
        for p in workers:
            p.wait(timeout=60)
        store.terminate()
        text = [log.read_text() for log in logs]
        assert [p.returncode for p in workers] == [0, 0, 0, 0], text
        finals = [_lines(tmp_path, f"w{k}")[-1]["final"] for k in range(4)]
        assert finals[0] == finals[1] == finals[2] == finals[3]  # 3 received the others' state
        assert finals[0]["size"] == 4
        first_back = _steps(tmp_path, "w3", 4, after[3])[0]
        last_of_three = _steps(tmp_path, "w0", 3, before[0])[-1]["step"]
        assert first_back["step"] > last_of_three  # it received the three's state, it did not start over
        assert not any("Gloo connectFullMesh failed" in t for t in text)  # no formation towards the cut pair
        print(
            f"cut -> 0, 1, 2 train on: {converged:.2f} s (timeout={TIMEOUT:g}); heal -> the four train: "
            f"{rejoined - healed_at:.2f} s"
        )


@pytest.mark.timeout(240)
def test_a_pair_cut_from_the_start_forms_without_one_side_which_raises_at_join_timeout(
    tmp_path: Path,
) -> None:
    join_timeout = 8.0
    with Hosts(5) as hosts:
        _cut(hosts, 2, 3)
        assert _connect(hosts, 2, 3) == "timeout"
        started = time.monotonic()
        store, workers, logs = _start(hosts, tmp_path, join_timeout=join_timeout)
        went_on = _wait(
            "0, 1, 2 training without 3",
            lambda: all(len(_steps(tmp_path, f"w{k}", 3)) >= 5 for k in (0, 1, 2)),
            120,
            workers[:3],
            logs,
        )
        workers[3].wait(timeout=join_timeout + 30)
        failed_at = time.monotonic()
        assert workers[3].returncode == 3, logs[3].read_text()
        error = _lines(tmp_path, "w3")[-1]["error"]
        # the pair, with both addresses, and the fix
        assert hosts.address(3) in error and hosts.address(2) in error, error
        assert "cannot connect to" in error and f"join_timeout={join_timeout:g}" in error, error
        assert "GLOO_SOCKET_IFNAME" in error
        assert _lines(tmp_path, "w3") == [_lines(tmp_path, "w3")[-1]]  # it never trained
        (tmp_path / "stop").write_text("any")
        for p in workers[:3]:
            p.wait(timeout=60)
        store.terminate()
        text = [log.read_text() for log in logs]
        assert [p.returncode for p in workers[:3]] == [0, 0, 0], text
        finals = [_lines(tmp_path, f"w{k}")[-1]["final"] for k in range(3)]
        assert finals[0] == finals[1] == finals[2] and finals[0]["size"] == 3
        assert not any("Gloo connectFullMesh failed" in t for t in text)
        print(
            f"start -> 0, 1, 2 train: {went_on - started:.2f} s; 3 raised {failed_at - started:.2f} s after "
            f"the start (join_timeout={join_timeout:g})"
        )
