"""The README's first command, exactly as written, in a fresh virtual environment, as a new user runs it.

The command is read from README.md (its first shell block), never copied here. The environment is a plain
`python -m venv` (no system site-packages, which would hide a dependency the command forgets to install);
PYTHONPATH is dropped for the same reason. The only help pip gets is a constraint pinning torch to the
build this interpreter runs (a constraint installs nothing): from this machine's wheels or index, as
`.ci/run` installs it, instead of whatever larger build the public index offers. The demo must end with its
verdict line, and its output must hold nothing a new user would puzzle over: no traceback, no Python
warning (torch warns at every import when NumPy is missing); its log must show the recovery it describes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from readme_commands import ROOT, top_commands

pytestmark = pytest.mark.venv

#: What examples/recover.py prints last when every worker ends with the same weights.
CLOSING = re.compile(r"final weights equal on every worker: [0-9a-f]{8}")
#: How Python prints a warning (`path:line: UserWarning: ...`); pip's own notes are `WARNING: ...`.
PY_WARNING = re.compile(r"\b\w*Warning: ")
COMMAND_TIMEOUT = 840  # seconds: a venv, torch unpacked from a local wheel, an editable build, the demo


def first_command() -> str:
    commands = top_commands()
    assert commands, "README.md's top has no ```bash block: where is the first command?"
    return commands[0].strip()


def fresh_env(venv: Path, constraints: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PIP_CONSTRAINT"] = str(constraints)
    env["PIP_NO_COMPILE"] = "1"  # no .pyc files written at install (torch's take a minute): the same install
    return env


@pytest.mark.timeout(COMMAND_TIMEOUT + 180)
def test_the_first_command_runs_the_demo_in_a_fresh_venv(tmp_path: Path) -> None:
    command = first_command()
    assert "pip install" in command and "examples/recover.py" in command, command
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={version('torch')}\n")
    env = fresh_env(venv, constraints)
    found = subprocess.run(
        ["bash", "-c", "command -v python"], env=env, capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == str(venv / "bin" / "python")
    try:
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=COMMAND_TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.output if isinstance(exc.output, str) else (exc.output or b"").decode(errors="replace")
        pytest.fail(f"{command!r} ran past {COMMAND_TIMEOUT} s; its output so far:\n{out[-4000:]}")
    out = done.stdout
    lines = [line for line in out.splitlines() if line.strip()]
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{out[-6000:]}"
    assert lines and CLOSING.fullmatch(lines[-1]), f"the demo's last line is not its verdict:\n{out[-3000:]}"
    assert "Traceback" not in out, out
    warnings = [line for line in lines if PY_WARNING.search(line)]
    assert not warnings, f"{command!r} printed warnings a new user would puzzle over: {warnings}"
    assert "Failed to initialize NumPy" not in out, out
    # What the demo shows (this is its only test): worker 2 killed, its slot restarted, the survivors went on
    # from the step they were at, the replacement received their state.
    killed = re.search(r"\[rank 2\] step (\d+): killing this worker \(SIGKILL\)", out)
    assert killed and int(killed.group(1)) >= 30, out  # --kill-at's default
    step = killed.group(1)
    assert "restarting slot 2 (restart 1 of 1)" in out, out
    survivor = rf"\[rank 0\] worker 0 \(life 0\): generation \d+ starts at step {step} as rank \d of [12]"
    assert re.search(survivor, out), out
    replacement = r"\[rank 2\] worker 2 \(life 1\): generation \d+ starts at step (\d+) as rank \d of 3"
    joined = re.search(replacement, out)
    assert joined and int(joined.group(1)) >= int(step), out
