"""`elastic.run` on separate hosts (network and pid namespaces, tests/netns.py): a silent cut.

Three worker hosts and a store host. Host 2 is unplugged while the three train with ``timeout=30``: its
packets are dropped, nobody gets a reset, its process stays alive. The survivors' all-reduce waits for it;
only their watch (host 2's heartbeat expired) ends that collective, so they train on without it long
before `timeout`. Plugged back, host 2 finds its generation over, rejoins as a newcomer and receives.
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

PORT = 29417
TIMEOUT = 30.0


def _lines(out: Path, host: str) -> list[dict[str, Any]]:
    path = out / f"{host}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(what: str, ok: Any, seconds: float, procs: list[Any]) -> float:
    """Poll `ok()` until it holds (returns when, monotonic); fail after `seconds` or if a worker exited."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ok():
            return time.monotonic()
        if any(p.poll() not in (None, 0) for p in procs):
            pytest.fail(f"a worker exited while waiting for {what}")
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {seconds} s")


def test_a_silent_cut_ends_the_survivors_collective_without_waiting_for_timeout(tmp_path: Path) -> None:
    with Hosts(4) as hosts:  # host 3 serves the store
        store = hosts.popen(
            3, [sys.executable, "-m", "elastic.store", "--port", str(PORT)], stderr=subprocess.DEVNULL
        )
        rdzv = f"{hosts.address(3)}:{PORT}"
        logs = [(tmp_path / f"w{k}.log").open("w") for k in range(3)]
        workers = [
            hosts.popen(
                k,
                [sys.executable, str(HERE / "cluster_worker.py"), rdzv, str(tmp_path), str(TIMEOUT)],
                env={"ELASTIC_TEST_HOST": f"w{k}"},
                stdout=logs[k],
                stderr=subprocess.STDOUT,
            )
            for k in range(3)
        ]
        _wait(
            "the three training together",
            lambda: all(sum(r.get("size") == 3 for r in _lines(tmp_path, f"w{k}")) >= 5 for k in range(3)),
            120,
            workers,
        )
        before = [len(_lines(tmp_path, f"w{k}")) for k in range(3)]
        hosts.cut(2)
        cut_at = time.monotonic()

        def survivors_went_on() -> bool:
            return all(
                sum(r.get("size") == 2 for r in _lines(tmp_path, f"w{k}")[before[k] :]) >= 5 for k in (0, 1)
            )

        # The survivors train on while host 2 is still cut off: without the watch their all-reduce would
        # wait for `timeout` (30 s), longer than the cut lasts (the test fails at this wait then).
        went_on = _wait("the survivors training without host 2", survivors_went_on, TIMEOUT - 5, workers)
        stuck = _lines(tmp_path, "w2")[before[2] :]
        assert stuck == [] or all(r.get("size") == 3 for r in stuck)  # host 2 made no step alone
        hosts.heal(2)
        for p in workers:
            p.wait(timeout=120)
        store.terminate()
        for f in logs:
            f.close()
        text = [(tmp_path / f"w{k}.log").read_text() for k in range(3)]
        assert [p.returncode for p in workers] == [0, 0, 0], text
        finals = [_lines(tmp_path, f"w{k}")[-1]["final"] for k in range(3)]
        assert finals[0] == finals[1] == finals[2]  # the rejoined host received the survivors' state
        assert finals[0]["sizes"][:3] == [3, 2, 3]
        assert "stopped heartbeating (dead or hung); ending its collectives" in text[0] + text[1]
        rejoined = _lines(tmp_path, "w2")
        # (a step of the cut's generation may finish on host 2 just after `before` was read: not a rejoin)
        cut = max(r["g"] for r in rejoined[: before[2]] if "g" in r)
        after = [r for r in rejoined[before[2] :] if "step" in r and r["size"] == 3 and r["g"] > cut]
        assert (
            after and after[0]["step"] > before[2] + 5
        )  # it received the newer state, it did not train alone
        print(f"survivors went on {went_on - cut_at:.2f} s after the cut (timeout={TIMEOUT:g})")


def test_a_store_restarted_empty_splits_nothing_and_loses_no_step(tmp_path: Path) -> None:
    """The store is killed and a new, empty one starts at its address while hosts 0 and 1 train; a
    newcomer (host 2) starts at once, on the empty store, racing the members' re-seed. It must not form a
    generation of its own (min_workers=1 would let it): it joins theirs and receives their state. Later
    host 1's worker is killed: hosts 0 and 2 regroup on the new store and go on. Every step is applied
    exactly once (``w == step * (step + 1) / 2``) and the survivors end alike."""
    env = {"ELASTIC_TEST_PLAN": "2,3,2", "ELASTIC_TEST_FIRST": "1", "ELASTIC_TEST_MIN": "1"}
    with Hosts(4) as hosts:  # host 3 serves the store
        serve = [sys.executable, "-m", "elastic.store", "--port", str(PORT)]
        store = hosts.popen(3, serve, stderr=subprocess.DEVNULL)
        rdzv = f"{hosts.address(3)}:{PORT}"
        logs = [(tmp_path / f"w{k}.log").open("w") for k in range(3)]

        def start(k: int) -> Any:
            argv = [sys.executable, str(HERE / "cluster_worker.py"), rdzv, str(tmp_path), "10"]
            return hosts.popen(
                k, argv, env={**env, "ELASTIC_TEST_HOST": f"w{k}"}, stdout=logs[k], stderr=subprocess.STDOUT
            )

        workers = [start(0), start(1)]
        _wait(
            "hosts 0 and 1 training together",
            lambda: all(sum(r.get("size") == 2 for r in _lines(tmp_path, f"w{k}")) >= 5 for k in range(2)),
            120,
            workers,
        )
        store.kill()
        store.wait(timeout=10)
        store = hosts.popen(3, serve, stderr=subprocess.DEVNULL)  # empty, same address
        restarted_at = max(r["step"] for r in _lines(tmp_path, "w0") if "step" in r)
        workers.append(start(2))  # the newcomer, on the empty store
        _wait(
            "the three training together",
            lambda: sum(r.get("size") == 3 for r in _lines(tmp_path, "w2")) >= 5,
            120,
            workers,
        )
        workers[1].kill()
        for p in (workers[0], workers[2]):
            p.wait(timeout=120)
        store.terminate()
        for f in logs:
            f.close()
        text = [(tmp_path / f"w{k}.log").read_text() for k in range(3)]
        assert (workers[0].returncode, workers[2].returncode) == (0, 0), text
        newcomer = _lines(tmp_path, "w2")
        trained = [r for r in newcomer if "step" in r]
        # no split brain: the newcomer never trained alone or from fresh weights
        assert trained and all(r["size"] >= 2 for r in trained), text[2]
        assert trained[0]["size"] == 3 and trained[0]["step"] > restarted_at, (trained[0], restarted_at)
        finals = [_lines(tmp_path, f"w{k}")[-1]["final"] for k in (0, 2)]
        assert finals[0] == finals[1]
        step = finals[0]["step"]
        assert finals[0]["w"] == [step * (step + 1) / 2] * 4  # every step applied exactly once
        assert finals[0]["sizes"][-3:] == [2, 3, 2]
        assert "restarted empty; re-seeding generation" in text[0] + text[1]
        steps0 = [r["step"] for r in _lines(tmp_path, "w0") if "step" in r]
        assert steps0 == sorted(steps0) and len(set(steps0)) == len(steps0)  # never went back: no step lost
