"""The README's first commands are the ones CI runs."""

from __future__ import annotations

from readme_commands import ROOT
from readme_commands import top_commands as _commands


def test_readme_starts_with_the_demo_and_test_commands() -> None:
    commands = _commands()
    assert len(commands) >= 2, "the README's top must show the demo command and the test command"
    demo, tests = commands[0], commands[1]
    assert "pip install" in demo and "python" in demo
    assert "pip install" in tests and "pytest" in tests


def test_ci_runs_exactly_the_readme_test_command() -> None:
    test_command = _commands()[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()
