"""The documentation site's sources: every public name in the API reference, every docstring complete,
every page in the navigation, every test the guarantees name present, the README short.

`mkdocs build --strict` (in .ci/run) checks links, anchors and that every `::: elastic.<name>` renders;
these checks need no mkdocs and run with the tests.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import attrs
import pytest

import elastic

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PUBLIC = [name for name in elastic.__all__ if name != "__version__"]


def _section(doc: str, title: str) -> str:
    """The body of a Google-style section (`Args:`, `Returns:`, ...) of a docstring, '' when absent."""
    match = re.search(rf"^{title}:\n((?:[ \t]+.*\n?|\n)+)", doc, flags=re.M)
    return match.group(1) if match else ""


def _documented(section: str) -> set[str]:
    return set(re.findall(r"^ {4}\**(\w+)(?: \(.*?\))?:", section, flags=re.M))


def _params(fn: object, skip: tuple[str, ...] = ()) -> list[str]:
    names = list(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    return [n for n in names if n not in ("self", *skip)]


def test_every_public_name_is_in_the_api_reference() -> None:
    text = "\n".join(p.read_text() for p in sorted((DOCS / "api").glob("*.md")))
    referenced = set(re.findall(r"^::: elastic\.(\w+)$", text, flags=re.M))
    assert sorted(set(PUBLIC) - referenced) == [], "add `::: elastic.<name>` to a page under docs/api/"
    assert sorted(referenced - set(PUBLIC)) == [], "the API reference names only public names"


FUNCTIONS = [n for n in PUBLIC if inspect.isfunction(getattr(elastic, n))]
METHODS = [
    ("ElasticSampler", ["set_epoch", "advance", "__iter__", "__len__", "state_dict", "load_state_dict"]),
    ("World", ["check", "busy", "progress"]),
    ("SaveHandle", ["wait", "done"]),
]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_public_functions_document_args_returns_and_raises(name: str) -> None:
    fn = getattr(elastic, name)
    doc = inspect.getdoc(fn) or ""
    params = _params(fn, skip=("args",) if name == "elastic_state" else ())
    missing = [p for p in params if p not in _documented(_section(doc, "Args"))]
    assert missing == [], f"elastic.{name}: Args misses {missing}"
    returns = inspect.signature(fn).return_annotation
    if returns not in ("None", None):
        assert _section(doc, "Returns"), f"elastic.{name}: no Returns section"
    if name != "local":  # local() raises nothing of its own
        assert _section(doc, "Raises"), f"elastic.{name}: no Raises section"


@pytest.mark.parametrize(("cls", "methods"), METHODS)
def test_public_methods_document_their_args(cls: str, methods: list[str]) -> None:
    for method in methods:
        fn = getattr(getattr(elastic, cls), method)
        doc = inspect.getdoc(fn) or ""
        assert doc, f"{cls}.{method} has no docstring"
        missing = [p for p in _params(fn) if p not in _documented(_section(doc, "Args"))]
        assert missing == [], f"{cls}.{method}: Args misses {missing}"


def test_classes_document_their_arguments_and_attributes() -> None:
    sampler_doc = inspect.getdoc(elastic.ElasticSampler) or ""
    args = _documented(_section(sampler_doc, "Args"))
    missing = [p for p in _params(elastic.ElasticSampler) if p not in args]
    assert missing == [], f"ElasticSampler: Args misses {missing}"
    for cls in (elastic.SyncReport, elastic.LoadReport):
        fields = [f.name for f in attrs.fields(cls)]
        documented = _documented(_section(inspect.getdoc(cls) or "", "Attributes"))
        assert [f for f in fields if f not in documented] == [], f"{cls.__name__}: Attributes incomplete"
    world = _documented(_section(inspect.getdoc(elastic.World) or "", "Attributes"))
    assert {"rank", "size", "generation", "group", "mesh"} <= world
    assert {"phase", "op"} <= _documented(_section(inspect.getdoc(elastic.SyncError) or "", "Attributes"))
    worker = _documented(_section(inspect.getdoc(elastic.WorkerError) or "", "Attributes"))
    assert {"rank", "exc_type", "exc_message", "remote_traceback"} <= worker
    for name in PUBLIC:
        obj = getattr(elastic, name)
        if inspect.isclass(obj) and issubclass(obj, elastic.ElasticError):
            assert (inspect.getdoc(obj) or "").count("\n") >= 2, f"{name}: say who raises it and when"


def test_every_page_is_in_the_navigation() -> None:
    nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?(\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert sorted(pages - nav) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(nav - pages) == [], "nav entries without a page"


def test_the_tests_the_guarantees_name_exist() -> None:
    text = (DOCS / "guarantees.md").read_text()
    tests = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "tests").rglob("test_*.py")}
    for row in (line for line in text.splitlines() if line.startswith("| ")):
        current = None
        for ref in re.findall(r"`((?:tests/[\w/]+\.py)?(?:::\w+)?)`", row):
            file, _, fn = ref.partition("::")
            if file:
                current = file
                assert current in tests, f"guarantees.md names {file}, which does not exist"
            if fn:
                assert current is not None, f"guarantees.md: {ref} without a file"
                assert re.search(rf"^(?:async )?def {fn}\(", tests[current], flags=re.M), f"{current}::{fn}"


def test_readme_is_short_and_its_links_exist() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 15_000, "the README is read in five minutes: move details to docs/"
    links = re.findall(r"\]\(((?!https?://)[^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links to the documentation"
    assert [link for link in links if not (ROOT / link).exists()] == []
    assert 'pip install -e ".[docs]" && mkdocs serve' in text


def test_mkdocstrings_sees_every_public_name_as_python_does() -> None:
    """`::: elastic.<name>` renders what griffe finds statically. A submodule or subpackage named like a
    public name (a package `elastic/sync/` next to the function `elastic.sync`) takes precedence there
    (griffe's documented limitation), so the page would silently show the package's docstring."""
    griffe = pytest.importorskip("griffe", reason="the docs extra is not installed")
    package = griffe.load("elastic", search_paths=[str(ROOT / "src")])
    for name in PUBLIC:
        obj = getattr(elastic, name)
        member = package.members.get(name)
        assert member is not None, f"griffe does not see elastic.{name}"
        expected = "class" if inspect.isclass(obj) else "function"
        assert member.kind.value == expected, (
            f"griffe sees elastic.{name} as a {member.kind.value}, Python as a {expected}: a submodule of "
            "that name shadows it in the API reference; rename the submodule"
        )


def test_the_architecture_page_names_every_module() -> None:
    text = (DOCS / "architecture.md").read_text()
    src = ROOT / "src"
    modules = [
        p for p in (src / "elastic").rglob("*.py") if p.name != "__init__.py" or p.parent == src / "elastic"
    ]
    missing = [
        p.relative_to(src).as_posix() for p in modules if f"`{p.relative_to(src).as_posix()}`" not in text
    ]
    assert missing == [], "docs/architecture.md: add a line for each new module"
