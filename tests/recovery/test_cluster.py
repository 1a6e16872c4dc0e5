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
        after = [r for r in rejoined[before[2] :] if "step" in r and r["size"] == 3]
        assert (
            after and after[0]["step"] > before[2] + 5
        )  # it received the newer state, it did not train alone
        print(f"survivors went on {went_on - cut_at:.2f} s after the cut (timeout={TIMEOUT:g})")
