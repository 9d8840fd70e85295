"""The built-in engine's registration (inflight/backends.py): `inflight serve` runs it in its own process."""

from __future__ import annotations

from typing import Any

from inflight.backends import BUILTIN, InferenceBackend, register


def options(s: Any, cuda: bool) -> list[str]:
    """server.* as `inflight serve` options."""
    return ["--dtype", s.dtype, "--max-batch", str(s.max_batch), "--max-model-len", str(s.max_model_len),
            "--max-tokens-per-step", str(s.max_tokens_per_step), "--threads", str(s.threads),
            "--low-priority-prefill", str(s.low_priority_prefill), "--low-priority-seqs", str(s.low_priority_seqs),
            *(["--generator-precision", s.generator_precision] if s.generator_precision != "float32" else []),
            *([] if s.prefix_reuse else ["--no-prefix-reuse"]),
            *(["--cuda-graphs", s.cuda_graphs] if s.cuda_graphs != "auto" else []),
            *(["--chat-template", s.chat_template] if getattr(s, "chat_template", "") else []),
            *(["--tool-call-parser", s.tool_call_parser] if getattr(s, "tool_call_parser", "auto") != "auto" else []),
            *(["--device", "cuda"] if cuda else [])]


BACKEND = register(InferenceBackend(
    name=BUILTIN, launcher=None, options="inflight.engine.builtin_backend:options",
    protocol="inflight", protocol_module="inflight.trainer.protocols.inflight",
    adapter="inflight.actor.adapters:parse_builtin", quick_start=True, restartable=True, ray=True))
