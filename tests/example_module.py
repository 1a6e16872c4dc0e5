"""Import an example script as a module (for its model, sizes and digest), without running its main."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_example(path: Path, name: str) -> ModuleType:
    """The script at `path` imported as module `name` (its ``if __name__ == "__main__"`` part not run)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
