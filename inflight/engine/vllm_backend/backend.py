"""The vLLM backend's registration (inflight/backends.py). Plain data: importing it never imports vLLM."""

from __future__ import annotations

from typing import Any

from inflight.backends import InferenceBackend, register


def options(s: Any, cuda: bool) -> list[str]:
    """server.* as vLLM's engine arguments (parsed by vLLM: launcher.py), and the chat template and tool-call
    parser our chat route over vLLM renders and reads replies with. vLLM picks its device itself
    (CUDA_VISIBLE_DEVICES is set per server) and its threads from OMP_NUM_THREADS, so no --device / --threads."""
    return ["--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_batch),
            "--max-num-batched-tokens", str(s.max_tokens_per_step),
            *(["--chat-template", s.chat_template] if getattr(s, "chat_template", "") else []),
            *(["--tool-call-parser", s.tool_call_parser] if getattr(s, "tool_call_parser", "auto") != "auto" else [])]


BACKEND = register(InferenceBackend(
    name="vllm", launcher="inflight.engine.vllm_backend.launcher:main",
    options="inflight.engine.vllm_backend.backend:options",
    protocol="vllm", protocol_module="inflight.trainer.protocols.vllm",
    adapter="inflight.actor.adapters:parse_vllm"))
