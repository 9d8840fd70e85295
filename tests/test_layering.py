"""The package's import structure: one floor per group of role folders, and a module imports only from its own folder
or from floors below its own; no import circles between modules. Imports inside functions count as well (a lazy
import is still a dependency). The allowed order is written once, here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "inflight"

# Bottom to top. `config` (inflight/config/) holds the RunConfig and one module of plain dataclasses per role, on the
# bottom floor, so every role may read any role's settings.
FLOORS: list[tuple[str, ...]] = [
    ("contracts", "process", "native", "config"),
    ("backends", "transport"),  # the backend registry; the weight transport both ends share (schemas, layouts, shm, ipc)
    ("tasks", "algo", "streams"),
    ("modelkit",),
    ("engine", "trainer", "rewards"),
    ("actor",),
    ("report",),  # the run's metrics file and the report read from it
    ("pipeline",),
    ("plan",),  # the simulator needs only config; its profiler drives engine, trainer, actor and a launcher's server
    ("cli",),
]
FLOOR = {part: i for i, parts in enumerate(FLOORS) for part in parts}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The inflight modules `name` imports (a package's submodule when `from pkg import submodule`)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or {base}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _folder(module: str) -> str:
    """The role folder (or top-level module) a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "inflight"


def test_every_folder_has_a_floor():
    missing = sorted({_folder(m) for m in MODULES} - FLOOR.keys() - {"inflight"})
    assert not missing, f"add these to FLOORS in {__file__}: {missing}"


def test_nothing_imports_upward():
    upward = []
    for module, targets in GRAPH.items():
        own = _folder(module)
        if own == "inflight":  # the package's __init__ (version only)
            continue
        for target in targets:
            other = _folder(target)
            if other != own and FLOOR[other] >= FLOOR[own]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports from a floor not below the module's own:\n" + "\n".join(sorted(upward))


def test_config_modules_import_only_config():
    bad = [f"{m} -> {t}" for m, ts in GRAPH.items() if _folder(m) == "config" for t in ts if _folder(t) != "config"]
    assert not bad, "config modules must stay plain data:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize("graph, circle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(graph, circle):
    assert _cycles(graph) == circle


def test_the_floor_rule_sees_an_upward_import():
    assert "inflight.pipeline.launcher" in GRAPH["inflight.pipeline.train"]  # lazy imports are read too
    assert FLOOR[_folder("inflight.pipeline.launcher")] > FLOOR[_folder("inflight.engine.api.server")]
    assert _folder("inflight.config.trainer") == "config" and _folder("inflight.pipeline.config_docs") == "pipeline"


def _function_imports_without_reason(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Imports inside a function whose first line has no `# lazy: <reason>` comment."""
    lines = path.read_text().splitlines()
    bad = []
    for node in ast.walk(ast.parse("\n".join(lines), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    comment = lines[inner.lineno - 1].partition("#")[2].strip()
                    if not comment.startswith("lazy:") or len(comment) <= len("lazy:") + 3:
                        bad.append(f"{path.relative_to(root)}:{inner.lineno}")
    return sorted(set(bad))


@pytest.mark.parametrize("folder", sorted({_folder(m) for m in MODULES}))
def test_imports_inside_functions_say_why(folder):
    """A module's top shows what it depends on; an import inside a function (an optional dependency, a start-up
    cost) carries `# lazy: <reason>` on its line."""
    paths = {MODULES[m] for m in MODULES if _folder(m) == folder}
    bad = [where for path in sorted(paths) for where in _function_imports_without_reason(path)]
    assert not bad, "move to the module's top, or add `# lazy: <reason>`:\n" + "\n".join(bad)


def test_the_reason_rule_sees_a_bare_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import json\n    import os  # lazy: optional dependency\n    import re  # lazy:\n")
    assert _function_imports_without_reason(path, tmp_path) == ["m.py:2", "m.py:4"]
