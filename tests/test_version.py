"""Packaging facts: the version is written once, and the license file matches pyproject."""

from __future__ import annotations

import re
from pathlib import Path

import elastic
from elastic import _version

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_written_once() -> None:
    assert elastic.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?(a|b|rc|dev|post)\d*)?", elastic.__version__)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and not re.search(r"(?m)^version\s*=", pyproject)
    assert '[tool.hatch.version]\npath = "src/elastic/_version.py"' in pyproject
    assert f"## {elastic.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_the_license_file_matches_pyproject() -> None:
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
