"""The tree's layers as docs/architecture.md draws them: no import circles, nothing imported
upward, and every file the page names where it says.

Imports are read from the source (``ast``), all of them: at a module's top, under
``TYPE_CHECKING`` and inside functions, so a circle hidden in a lazy import counts too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "deployments", "cluster", "observability", "bench", "tests")

# engine's layers, lowest first: a module may import its own layer's and lower layers' modules
ENGINE_LAYERS = (
    ("values", ("engine.errors", "engine.config", "engine.media")),
    ("native", ("engine.native",)),
    ("text", ("engine.text",)),
    ("requests", ("engine.params", "engine.types", "engine.sampling", "engine.cost", "engine.batching")),
    ("slots", ("engine.slots", "engine.budget")),
    ("caches", ("engine.cache",)),
    ("plan", ("engine.planner",)),  # a step's plan: rows, copies, media entries
    ("speculation", ("engine.speculation",)),
    ("step loop", ("engine",)),  # the rest of engine/
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """The project's modules ``path`` imports. ``from pkg import sub`` is an edge to ``sub``
    alone: Python runs a package's ``__init__`` before any of its modules, which is no circle of
    the design's."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(node.module)
    return {m for m in out if m in MODULES} - {module_name(path)}


GRAPH = {m: imports_of(p) for m, p in MODULES.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def engine_layer(module: str) -> int:
    for rank, (_, prefixes) in enumerate(ENGINE_LAYERS[:-1]):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return len(ENGINE_LAYERS) - 1


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_project_is_in_an_import_circle() -> None:
    assert circles(GRAPH) == []


def test_no_engine_module_imports_a_higher_layer() -> None:
    upward = [
        f"{m} ({ENGINE_LAYERS[engine_layer(m)][0]}) imports {t} ({ENGINE_LAYERS[engine_layer(t)][0]})"
        for m, targets in GRAPH.items() if m.startswith("engine")
        for t in targets if t.startswith("engine") and engine_layer(t) > engine_layer(m)
    ]
    assert not upward, upward
    assert engine_layer("engine.text.tools") > engine_layer("engine.native.model") > engine_layer("engine.errors")
    assert engine_layer("engine.group") == len(ENGINE_LAYERS) - 1


def test_the_engine_imports_no_ray_no_deployment_and_no_test_tooling() -> None:
    for m, path in MODULES.items():
        if not m.startswith("engine"):
            continue
        named = {t.split(".")[0] for t in GRAPH[m]}
        assert not named & {"deployments", "cluster", "bench", "tests"}, (m, named)
        assert not re.search(r"^\s*(import ray|from ray)\b", path.read_text(), re.M), m


def test_observability_imports_no_deployment_and_no_cluster() -> None:
    for m in MODULES:
        if m.startswith("observability"):
            assert not {t.split(".")[0] for t in GRAPH[m]} & {"deployments", "cluster"}, m


def test_the_product_imports_no_test_tooling() -> None:
    for m in MODULES:
        if m.split(".")[0] in ("engine", "deployments", "cluster", "observability"):
            assert not any(t.startswith("tests") for t in GRAPH[m]), m


def test_every_package_says_what_it_holds() -> None:
    for init in [REPO / pkg / "__init__.py" for pkg in PACKAGES] + list((REPO / "engine").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        readme = init.parent / "README.md"
        if init.parent.name in ("tests", "bench", "cluster", "observability", "deployments"):
            continue  # the top folders are drawn by docs/architecture.md
        assert doc or readme.exists(), f"{init.parent.relative_to(REPO)} says nothing of what it holds"


def tree_files() -> list[tuple[str, Path]]:
    """Each ``name.py`` the page's tree names, with the folder the tree puts it in: a top folder
    at column 0, an engine subpackage as an indented ``sub/``."""
    page = (REPO / "docs" / "architecture.md").read_text()
    tree = page.split("```")[1]
    named: list[tuple[str, Path]] = []
    top: Path | None = None
    sub: Path | None = None
    for line in tree.splitlines():
        if m := re.match(r"^([a-z_]+)/\s", line):
            top, sub = REPO / m.group(1), None
        elif top is not None and top.name == "engine" and (m := re.match(r"^  ([a-z_]+)/\s", line)):
            sub = top / m.group(1)
        elif top is not None and top.name == "engine" and re.match(r"^  [a-z_]+\.py", line):
            sub = None
        for name in re.findall(r"\b([a-z_]+\.py)\b", line):
            named.append((name, (sub or top) if top is not None else REPO))
    return named


def test_every_file_the_architecture_page_names_is_where_it_says() -> None:
    named = tree_files()
    assert len(named) > 60
    missing = []
    for name, folder in named:
        if folder.parent.name == "engine" or folder.name == "engine":
            if not (folder / name).exists():
                missing.append(str((folder / name).relative_to(REPO)))
        elif not any(folder.rglob(name)):
            missing.append(f"{name} under {folder.relative_to(REPO)}")
    assert not missing, f"docs/architecture.md names files that are not there: {missing}"


def test_the_request_path_names_files_that_exist() -> None:
    page = (REPO / "docs" / "architecture.md").read_text()
    path = page.split("## One request's path", 1)[1]
    names = set(re.findall(r"\b([a-z_]+(?:/[a-z_]+)*\.py)\b", path))
    assert len(names) > 10
    missing = [n for n in names if not any((REPO / pkg).rglob(n.split("/")[-1]) for pkg in ("deployments", "engine"))]
    assert not missing, missing
