"""Whether a process of this host is still running."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["running"]


def running(pid: int) -> bool:
    """False once process `pid` has exited (a zombie, waiting to be reaped, has exited).

    Where ``/proc`` exists its state letter decides; elsewhere signal 0 does (a process this user may not
    signal still counts as running).
    """
    if Path("/proc/self").exists():
        try:
            stat = (Path("/proc") / str(pid) / "stat").read_text()
            return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
