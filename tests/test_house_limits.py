"""Size limits of inflight/ and inflight_plan/, so that each part stays readable: no folder of more than 15 modules,
no function over 120 lines, no module over 500 lines, contracts.py at most 250 lines, and docs/benchmarks.md (the
current figure of each measurement only) at most 600 lines. Each check reports every offender, with its size."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "inflight"
PACKAGES = (PACKAGE, ROOT / "inflight_plan")  # the runtime and the planner beside it

MAX_MODULES_PER_FOLDER = 15  # __init__.py not counted
MAX_FUNCTION_LINES = 120
MAX_MODULE_LINES = 500
MAX_CONTRACTS_LINES = 250
MAX_BENCHMARKS_DOC_LINES = 600


def crowded_folders(package: Path) -> dict[str, int]:
    counts = {}
    for folder in [package, *(p for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        n = sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")
        if n > MAX_MODULES_PER_FOLDER:
            counts[str(folder.relative_to(package.parent))] = n
    return counts


def long_functions(package: Path) -> dict[str, int]:
    found = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{path.relative_to(package.parent)}:{node.lineno} {node.name}"] = lines
    return found


def long_modules(package: Path) -> dict[str, int]:
    sizes = {str(p.relative_to(package.parent)): len(p.read_text().splitlines()) for p in package.rglob("*.py")}
    return {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}


def test_no_folder_holds_more_than_15_modules():
    assert [crowded_folders(p) for p in PACKAGES] == [{}, {}]


def test_no_function_is_longer_than_120_lines():
    assert [long_functions(p) for p in PACKAGES] == [{}, {}]


def test_no_module_is_longer_than_500_lines():
    assert [long_modules(p) for p in PACKAGES] == [{}, {}]


def test_contracts_and_the_benchmarks_doc_stay_short():
    assert len((PACKAGE / "contracts.py").read_text().splitlines()) <= MAX_CONTRACTS_LINES
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= MAX_BENCHMARKS_DOC_LINES


def test_the_checks_see_an_offender(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "crowded").mkdir(parents=True)
    for i in range(MAX_MODULES_PER_FOLDER + 1):
        (pkg / "crowded" / f"m{i}.py").write_text("x = 1\n")
    body = "".join("    x = 1\n" for _ in range(MAX_FUNCTION_LINES))
    (pkg / "long.py").write_text("def f():\n" + body + "\n" * (MAX_MODULE_LINES - MAX_FUNCTION_LINES))
    assert crowded_folders(pkg) == {"pkg/crowded": MAX_MODULES_PER_FOLDER + 1}
    assert long_functions(pkg) == {"pkg/long.py:1 f": MAX_FUNCTION_LINES + 1}
    assert long_modules(pkg) == {"pkg/long.py": MAX_MODULE_LINES + 1}
