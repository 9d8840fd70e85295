"""The vLLM backend's registration (inflight/backends.py). Plain data: importing it never imports vLLM."""

from __future__ import annotations

from typing import Any

from inflight.backends import InferenceBackend, register
from inflight.config.engine import to_argv
from inflight.engine.vllm_backend.launcher import SETTINGS


def options(s: Any, cuda: bool) -> list[str]:
    """server.* as vLLM's engine arguments (parsed by vLLM: launcher.py), then the settings our app over vLLM reads
    (launcher.SETTINGS: the chat template and tool-call parser our chat route renders and reads replies with, ...;
    the API key comes from launch_common.server_argv). vLLM picks its device itself (CUDA_VISIBLE_DEVICES is set per
    server) and its threads from OMP_NUM_THREADS, so no --device / --threads."""
    return ["--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_batch),
            "--max-num-batched-tokens", str(s.max_tokens_per_step), *to_argv(s, SETTINGS, skip=("api_key",))]


BACKEND = register(InferenceBackend(
    name="vllm", launcher="inflight.engine.vllm_backend.launcher:main",
    options="inflight.engine.vllm_backend.backend:options",
    protocol="vllm", protocol_module="inflight.trainer.weight_sync.vllm",
    adapter="inflight.actor.response_parsers:parse_vllm"))
