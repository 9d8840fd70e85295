"""The SGLang backend's registration (inflight/backends.py). Plain data: importing it never imports SGLang."""

from __future__ import annotations

from typing import Any

from inflight.backends import InferenceBackend, register


def options(s: Any, cuda: bool) -> list[str]:
    """server.* as SGLang's server arguments (launcher.py). SGLang picks its device itself (CUDA_VISIBLE_DEVICES
    is set per server) and its threads from OMP_NUM_THREADS, so no --device / --threads."""
    return ["--dtype", s.dtype, "--context-length", str(s.max_model_len), "--max-running-requests", str(s.max_batch),
            "--chunked-prefill-size", str(s.max_tokens_per_step)]


BACKEND = register(InferenceBackend(
    name="sglang", launcher="inflight.engine.sglang_backend.launcher:main",
    options="inflight.engine.sglang_backend.backend:options",
    protocol="sglang", protocol_module="inflight.trainer.weight_sync.sglang",
    adapter="inflight.actor.response_parsers:parse_sglang"))
