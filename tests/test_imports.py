"""The import graph of `src/elastic`: no cycle, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "elastic"
SRC = Path(__file__).resolve().parent.parent / "src" / PACKAGE
#: Modules that are packages (their relative imports resolve inside them).
PACKAGES = {PACKAGE} | {
    ".".join([PACKAGE, *p.parent.relative_to(SRC).parts]) for p in SRC.rglob("__init__.py") if p.parent != SRC
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    if level == 0:
        return target or ""
    package = module if module in PACKAGES else module.rsplit(".", 1)[0]
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - (level - 1)])
    return f"{base}.{target}" if target else base


def imports_of(module: str, source: str, known: set[str]) -> set[str]:
    """The package's modules that `module` imports anywhere in `source` (module level or in functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in known:  # `import elastic._x.y` imports elastic._x
                    name = name.rpartition(".")[0]
                if name:
                    found.add(name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from . import _sync` imports the module itself
                    found.add(sub)
                elif base in known:
                    found.add(base)
    found.discard(module)
    return found


def graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: imports_of(name, path.read_text(), known) for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `edges` as a path that ends where it starts, or `None`."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_resolve_relative_imports() -> None:
    known = {"elastic", "elastic._a", "elastic._b", "elastic._c"}
    source = (
        "from . import _a\n"
        "from ._b import thing\n"
        "import elastic._c\n"
        "from . import version_in_init\n"
        "import torch\n"
        "def f():\n"
        "    from ._a import late\n"
    )
    assert imports_of("elastic._x", source, known) == {"elastic", "elastic._a", "elastic._b", "elastic._c"}


def test_find_cycle_names_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_function_level_imports_count() -> None:
    known = {"elastic._a", "elastic._b"}
    edges = {
        "elastic._a": imports_of("elastic._a", "def f():\n    from ._b import x\n", known),
        "elastic._b": imports_of("elastic._b", "from ._a import y\n", known),
    }
    assert find_cycle(edges) == ["elastic._a", "elastic._b", "elastic._a"]


def test_the_package_has_no_import_cycle() -> None:
    edges = graph()
    assert "elastic.replication.sync" in edges and "elastic.state.decorator" in edges
    assert "elastic.state.config" in edges["elastic.replication.sync"]  # sync registers its method there
    # the state layer knows nothing above it: the methods it attaches register themselves
    assert not {
        e for e in edges["elastic.state.decorator"] if not e.startswith(("elastic.state", "elastic._util"))
    }
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
