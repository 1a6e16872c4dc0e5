"""The shell commands at the top of README.md (before its first section), as a new user copies them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def top_commands() -> list[str]:
    """The fenced ``bash``/``sh`` blocks before the README's first ``## `` section, in order."""
    text = (ROOT / "README.md").read_text()
    head = text.split("\n## ", 1)[0]
    return re.findall(r"```(?:bash|sh)\n(.+?)\n```", head, flags=re.S)
