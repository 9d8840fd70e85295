"""The Python packages the GPU window needs, checked before the bench runs (scripts/gpu-run.sh) and rehearsed in CI
(tests/test_gpu_imports.py), so a missing wheel fails here and not in the 15 minutes of device time.

    python scripts/gpu_imports.py                # import what the bench's stages import, in this environment
    python scripts/gpu_imports.py --as-gpu-image # the same, refusing every package that is neither on the GPU
                                                 # image (docs/backends.md) nor carried (scripts/gpu-wheels.sh)

`--as-gpu-image` puts every finder on sys.meta_path behind a guard that makes any other top-level module look absent
(as on the image: `import` raises ModuleNotFoundError, importlib.util.find_spec returns None). The standard library and
this repository's own modules always pass. With INFLIGHT_AS_GPU_IMAGE=1 in the environment and this folder's
`image_guard/` on PYTHONPATH, every Python process started below installs it too (its sitecustomize.py): the CPU
dry run of the bench then runs as it would on the image. What it cannot emulate: the image's versions (the check
sees this environment's), CPython 3.12 vs this one, and GPU-only code paths (triton, CUDA IPC: on the image).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import re
import sys
import sysconfig
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "backends.md"
WHEELS = ROOT / "scripts" / "gpu-wheels.sh"

# What the bench's processes import: the driver and its stages (scripts/), `inflight serve` (the servers),
# `inflight train` (launcher, trainer, actor, streams, report) and the lazy imports on those paths that a plain
# module import does not reach. Extend it when a stage imports something new.
MODULES = (
    "gpu_bench", "bench_common", "bench_engine", "bench_trainer", "bench_push", "bench_pipeline", "gpu_smoke",
    "smoke_server", "smoke_trainer", "bench.pipeline",
    "inflight.cli", "inflight.engine.serve", "inflight.engine.api.server", "inflight.engine.builtin_backend",
    "inflight.engine.model.graph_runner", "inflight.engine.model.decode_attention", "inflight.engine.weights.ipc_receiver",
    "inflight.pipeline.launch_common", "inflight.pipeline.supervise", "inflight.report.page",
    "inflight.pipeline.demo", "inflight.report.metrics", "inflight.pipeline.progress",
    "inflight.trainer.factory", "inflight.trainer.fsdp", "inflight.trainer.single", "inflight.trainer.kernels.varlen",
    "inflight.trainer.weight_sync", "inflight.trainer.weight_sync.inflight", "inflight.trainer.weight_sync.ipc_push",
    "inflight.streams.serialize", "inflight.actor.run", "inflight.tasks", "inflight.modelkit.build",
    "inflight.config", "inflight.transport.cuda_ipc", "inflight.transport.shm",
    # lazy on the bench's paths
    "uvicorn", "fastapi", "httptools", "uvloop", "orjson", "omegaconf", "msgpack", "redis", "httpx", "aiohttp",
    "safetensors", "transformers", "peft", "accelerate", "tokenizers", "yaml", "tqdm", "numpy",
    "prometheus_client", "pydantic", "torch.distributed.fsdp", "torch.profiler",
)
# Not needed on the GPU (the bench runs without them); absent from the image is fine.
OPTIONAL = ("matplotlib",)  # the report writes its tables without plots when it is missing


def _names(text: str) -> set[str]:
    return {norm(n) for n in re.split(r"[\s,]+", text) if n}


def norm(name: str) -> str:
    """A distribution name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(docs: Path = DOCS) -> set[str]:
    """The GPU image's Python distributions: the indented block after "holds these Python packages" in
    docs/backends.md."""
    m = re.search(r"holds these Python packages.*?\n\n((?:    [^\n]*\n)+)", docs.read_text(), re.S)
    if not m:
        raise ValueError(f"{docs}: no indented package list after 'holds these Python packages'")
    return _names(m.group(1))


def carried_packages(script: Path = WHEELS) -> set[str]:
    """The distributions scripts/gpu-wheels.sh downloads (every NAME==VERSION in it)."""
    return {norm(n) for n in re.findall(r"([A-Za-z0-9][A-Za-z0-9_.-]*)==[0-9]", script.read_text())}


def with_requirements(dists: set[str]) -> set[str]:
    """`dists` and, recursively, what their versions installed here require (extras left out). For the image's
    packages only: the image satisfies its own packages' requirements, and where this environment's newer versions
    need more, that is no gap of the image's."""
    from packaging.requirements import Requirement

    out, todo = set(), list(dists)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        try:
            reqs = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(norm(r.name))
    return out


def allowed_modules(dists: set[str]) -> set[str]:
    """Top-level import names that the distributions `dists` provide, as installed here."""
    return {module for module, owners in importlib.metadata.packages_distributions().items()
            if any(norm(o) in dists for o in owners)}


class Guard:
    """Which top-level modules exist: the standard library, this repository's own, and `allowed`; the others are
    reported absent by every finder (`refused` records them)."""

    def __init__(self, allowed: set[str], root: Path = ROOT):
        self.allowed = allowed
        # this repository's modules (inflight, scripts/, bench/, tests/) and the standard library's files (private
        # ones such as _sysconfigdata_* too), not the packages of a venv inside either
        self.homes = (str(root) + os.sep, *(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib")))
        self.refused: set[str] = set()

    def allows(self, name: str, spec: importlib.machinery.ModuleSpec) -> bool:
        if name in self.allowed or name in sys.stdlib_module_names or name in sys.builtin_module_names:
            return True
        where = [spec.origin or "", *(spec.submodule_search_locations or [])]
        return any(w.startswith(self.homes) and "-packages" not in w for w in where)


class _Finder(importlib.abc.MetaPathFinder):
    """One of sys.meta_path's finders, behind the guard: a refused top-level module is not found."""

    def __init__(self, inner, guard: Guard):
        self.inner, self.guard = inner, guard

    def find_spec(self, name, path=None, target=None):
        spec = self.inner.find_spec(name, path, target) if hasattr(self.inner, "find_spec") else None
        if spec is None or path is not None or "." in name or self.guard.allows(name, spec):
            return spec
        self.guard.refused.add(name)
        return None

    def __getattr__(self, attr):  # find_distributions, invalidate_caches, ...: the wrapped finder's
        return getattr(self.inner, attr)


def install(image: set[str] | None = None, carried: set[str] | None = None) -> Guard:
    """Every finder on sys.meta_path behind a guard that allows the image's and the carried packages (default:
    the lists in docs/backends.md and scripts/gpu-wheels.sh)."""
    image = image_packages() if image is None else image
    carried = carried_packages() if carried is None else carried
    guard = Guard(allowed_modules(with_requirements(image) | carried))
    sys.meta_path[:] = [_Finder(f, guard) for f in sys.meta_path]
    return guard


def check(modules: tuple[str, ...] = MODULES) -> list[str]:
    """Import each module; the failures, one line each."""
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  (every failure is reported)
            failed.append(f"{name}: {type(e).__name__}: {e}")
            if os.environ.get("GPU_IMPORTS_TRACE"):
                traceback.print_exc()
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--as-gpu-image", action="store_true", help="refuse packages neither on the image nor carried")
    a = ap.parse_args(argv)
    guard = install() if a.as_gpu_image else None
    failed = check()
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
        except ImportError:
            print(f"gpu_imports: optional {name} is missing (the run goes on without it)")
    for line in failed:
        print(f"gpu_imports: FAILED {line}")
    if guard is not None and guard.refused:
        print(f"gpu_imports: absent from the image and not carried, so not found: {sorted(guard.refused)}")
    print(f"gpu_imports: {len(MODULES) - len(failed)} of {len(MODULES)} modules import"
          + (" (as on the GPU image)" if guard else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
