"""A user's code is type-checked: `elastic.StateMethods` shows the methods `@elastic_state` adds.

mypy (and pyright, where it is installed) checks one small user file written to a temporary directory;
every line that must be reported ends with ``# error: <words the message holds>``, every other line must
pass. The checkers run once per module (a cold mypy run over torch's stubs takes a while; mypy shares the
project's settings and cache).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import torch

import elastic
from elastic import elastic_state

ROOT = Path(__file__).resolve().parents[1]

USER = textwrap.dedent(
    """
    from pathlib import Path

    import attrs
    import torch
    from torch.distributed.checkpoint.stateful import Stateful

    import elastic
    from elastic import elastic_state


    @elastic_state(tenure="step")
    @attrs.define
    class S(elastic.StateMethods):
        model: torch.nn.Module
        step: int = 0
        scratch: dict = elastic.local(factory=dict)


    @elastic_state(tenure=lambda s: s.step)
    @attrs.frozen
    class Frozen(elastic.StateMethods):
        step: int = 0


    def train(state: S, world: elastic.World) -> int:
        return state.step + world.rank


    def train_one(state: S) -> None: ...


    s = S(torch.nn.Linear(2, 2))
    r: elastic.SyncReport = s.sync()
    reveal_type(s.sync(force=True, timeout=5))
    p = s.save("ckpt/")
    reveal_type(p)
    reveal_type(s.save(Path("ckpt"), keep=None, blocking=False))
    reveal_type(s.load("ckpt/", trusted=True))
    s.load_state_dict(s.state_dict())
    stateful: Stateful = s
    elastic.run(lambda st, w: None, s)
    elastic.run(train, s, min_workers=2)
    S()  # error: model
    s.synk()  # error: synk
    s.sync(3)  # error: positional
    s.save()  # error: argument
    s.load("ckpt/", strict="yes")  # error: strict
    elastic.run(lambda st: None, s)  # error: run
    elastic.run(train_one, s)  # error: run
    Frozen().step = 1  # error: step
    """
)

#: What `reveal_type` must show for each revealing line (mypy's spelling, then pyright's), in order.
REVEALED = [
    ("elastic.replication.sync.SyncReport", "SyncReport"),
    ("pathlib.Path | str", "Path | str"),
    ("elastic.checkpoint.saveload.SaveHandle", "SaveHandle"),
    ("elastic.checkpoint.saveload.LoadReport", "LoadReport"),
]


def expected_errors(text: str) -> dict[int, str]:
    """Line number -> the word its error must name, from the ``# error: word`` comments."""
    found = {n: re.search(r"# error: (\w+)", line) for n, line in enumerate(text.splitlines(), 1)}
    return {n: m.group(1) for n, m in found.items() if m}


def reveal_lines(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1) if line.startswith("reveal_type(")]


@pytest.fixture(scope="module")
def user_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("user") / "user.py"
    path.write_text(USER)
    return path


@pytest.fixture(scope="module")
def mypy_output(user_file: Path) -> dict[int, list[str]]:
    """mypy's messages on the user file, by line: errors as "error: ...", reveal_type as "note: ...".

    The project's own settings (pyproject.toml) and cache: where `mypy` has just checked the package, as
    CI does before the tests, torch's stubs are not analysed again. mypy runs in its own process: in this
    one, the millions of objects it keeps would slow every later garbage collection, and the one at exit
    by a minute."""
    args = [str(user_file), "--config-file", str(ROOT / "pyproject.toml")]
    done = subprocess.run(
        [sys.executable, "-m", "mypy", *args],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
        cwd=ROOT,  # the settings' paths (mypy_path, the cache) are relative to it
    )
    assert done.returncode in (0, 1) and not done.stderr, done.stdout + done.stderr  # 1: errors reported
    by_line: dict[int, list[str]] = {}
    for line in done.stdout.splitlines():
        # a warm cache replays the messages of an identical file under the path it had then
        m = re.match(r"(?:.*/)?user\.py:(\d+): (error|note): (.*)", line)
        if m:
            by_line.setdefault(int(m.group(1)), []).append(f"{m.group(2)}: {m.group(3)}")
    return by_line


@pytest.mark.timeout(600)
def test_mypy_passes_correct_use_and_reports_each_mistake(mypy_output: dict[int, list[str]]) -> None:
    expected = expected_errors(USER)
    errors = {n: [m for m in msgs if m.startswith("error")] for n, msgs in mypy_output.items()}
    unexpected = {n: msgs for n, msgs in errors.items() if msgs and n not in expected}
    assert not unexpected, f"mypy reports correct use as wrong: {unexpected}"
    for n, word in expected.items():
        assert any(word in m for m in errors.get(n, [])), (
            f"line {n} {USER.splitlines()[n - 1].strip()!r}: expected an error naming {word!r}, "
            f"mypy said {errors.get(n)}"
        )


@pytest.mark.timeout(600)
def test_mypy_sees_the_methods_return_types(mypy_output: dict[int, list[str]]) -> None:
    lines = reveal_lines(USER)
    assert len(lines) == len(REVEALED)
    for n, (want, _) in zip(lines, REVEALED):
        assert mypy_output.get(n) == [f'note: Revealed type is "{want}"'], (n, mypy_output.get(n))


def _pyright() -> str:
    exe = shutil.which("pyright")
    if exe is None:
        pytest.skip("pyright is not installed (pip install pyright; it runs on node)")
    probe = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"pyright does not run here: {probe.stdout[-300:]}{probe.stderr[-300:]}")
    return exe


@pytest.mark.timeout(600)
def test_pyright_passes_correct_use_and_reports_each_mistake(user_file: Path) -> None:
    exe = _pyright()
    folder = user_file.parent
    (folder / "pyrightconfig.json").write_text(
        json.dumps({"extraPaths": [str(ROOT / "src")], "pythonVersion": "3.10", "include": ["user.py"]})
    )
    done = subprocess.run(
        [exe, "--outputjson", "-p", str(folder)], capture_output=True, text=True, cwd=folder, timeout=540
    )
    report = json.loads(done.stdout)
    by_line: dict[int, list[dict]] = {}
    for d in report["generalDiagnostics"]:
        by_line.setdefault(d["range"]["start"]["line"] + 1, []).append(d)
    expected = expected_errors(USER)
    errors = {n: [d["message"] for d in ds if d["severity"] == "error"] for n, ds in by_line.items()}
    unexpected = {n: msgs for n, msgs in errors.items() if msgs and n not in expected}
    assert not unexpected, f"pyright reports correct use as wrong: {unexpected}"
    missed = {n: word for n, word in expected.items() if not errors.get(n)}
    assert not missed, f"pyright misses the mistakes on lines {missed}"
    for n, (_, want) in zip(reveal_lines(USER), REVEALED):
        infos = [d["message"] for d in by_line.get(n, []) if d["severity"] == "information"]
        assert any(m.endswith(f'is "{want}"') for m in infos), (n, infos)


def test_state_methods_change_nothing_at_run_time() -> None:
    assert "StateMethods" in elastic.__all__
    assert [k for k in vars(elastic.StateMethods) if not k.startswith("__")] == []

    @elastic_state(tenure="step")
    @attrs.define
    class Slotted(elastic.StateMethods):
        model: torch.nn.Module
        step: int = 0

    state = Slotted(torch.nn.Linear(2, 2), step=4)
    assert not hasattr(state, "__dict__"), "the base must keep a slotted state slotted"
    for name in ("sync", "save", "load", "state_dict", "load_state_dict"):
        assert name in vars(Slotted), name
    report = state.sync()  # no process group: a local no-op that reports the state's tenure
    assert isinstance(report, elastic.SyncReport)
    assert report.tenure == 4
