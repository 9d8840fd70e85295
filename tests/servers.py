"""Test servers shared by several test modules."""

from __future__ import annotations

from pathlib import Path


def serve_model(model_dir: Path, *args: str):
    """`inflight serve` on a model folder in a subprocess (1 thread, 512 tokens of context), as a context manager:
    the body of a module's `server` fixture."""
    from inflight.engine.serve import ServerProcess

    return ServerProcess(str(model_dir), extra_args=["--max-model-len", "512", *args], env={"OMP_NUM_THREADS": "1"})
