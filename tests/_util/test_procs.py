"""`running`: a live process runs, an exited one (reaped or a zombie) does not."""

from __future__ import annotations

import os
import subprocess
import sys

from elastic._util.procs import running


def test_running_and_exited() -> None:
    assert running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert running(child.pid)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert not running(child.pid)  # reaped (a pid is not reused this fast)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    try:
        assert not running(zombie.pid)
    finally:
        zombie.wait()
