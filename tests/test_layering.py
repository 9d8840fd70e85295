"""The package's import structure: one floor per group of role folders, and a module imports only from its own folder
or from floors below its own; no import circles between modules. Imports inside functions count as well (a lazy
import is still a dependency). The allowed order is written once, here. The planner (inflight_plan/, beside the
package) stands above every floor: it imports from inflight, and nothing in inflight imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "inflight"
PLANNER = PACKAGE.parent / "inflight_plan"  # `inflight profile` / `inflight plan`; the CLI names it by module path only

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
    ("cli",),
]
FLOOR = {part: i for i, parts in enumerate(FLOORS) for part in parts}


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()
PLAN_MODULES = _modules(PLANNER)


def _imports(name: str, path: Path, modules: dict[str, Path] = MODULES) -> set[str]:
    """The modules of `modules` that `name` imports (a package's submodule when `from pkg import submodule`)."""
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
            subs = {f"{base}.{a.name}" for a in node.names} & modules.keys()
            found |= subs or {base}
    return {m for m in found if m in modules and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}
PLAN_GRAPH = {name: _imports(name, path, PLAN_MODULES) for name, path in PLAN_MODULES.items()}


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


def test_nothing_in_the_package_imports_the_planner():
    """The planner sits beside the package and imports from it, never the reverse; the CLI's table names its two
    commands by module path (a string, imported only when the command runs)."""
    bad = [f"{m} -> {t}" for m, path in MODULES.items() for t in _imports(m, path, PLAN_MODULES)]
    assert not bad, "inflight must not import inflight_plan:\n" + "\n".join(sorted(bad))


def test_the_planner_rule_sees_an_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from inflight_plan.sim import simulate  # lazy: a test\n")
    assert _imports("inflight.m", path, PLAN_MODULES) == {"inflight_plan.sim"}


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
    assert _cycles(PLAN_GRAPH) == []


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


@pytest.mark.parametrize("folder", sorted({_folder(m) for m in MODULES}) + ["inflight_plan"])
def test_imports_inside_functions_say_why(folder):
    """A module's top shows what it depends on; an import inside a function (an optional dependency, a start-up
    cost) carries `# lazy: <reason>` on its line. The planner (`inflight_plan`) keeps the same rule."""
    if folder == "inflight_plan":
        paths = set(PLAN_MODULES.values())
    else:
        paths = {MODULES[m] for m in MODULES if _folder(m) == folder}
    bad = [where for path in sorted(paths) for where in _function_imports_without_reason(path)]
    assert not bad, "move to the module's top, or add `# lazy: <reason>`:\n" + "\n".join(bad)


def test_the_reason_rule_sees_a_bare_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import json\n    import os  # lazy: optional dependency\n    import re  # lazy:\n")
    assert _function_imports_without_reason(path, tmp_path) == ["m.py:2", "m.py:4"]
