"""The built-in engine's registration (inflight/backends.py): `inflight serve` runs it in its own process."""

from __future__ import annotations

from typing import Any

from inflight.backends import BUILTIN, InferenceBackend, register
from inflight.config.engine import to_argv


def options(s: Any, cuda: bool) -> list[str]:
    """server.* as `inflight serve` options: every setting (config/engine.py) not at its default, by the same mapping
    that generates serve's options; the API key is every backend's (launch_common.server_argv)."""
    return [*to_argv(s, skip=("api_key",)), *(["--device", "cuda"] if cuda else [])]


BACKEND = register(InferenceBackend(
    name=BUILTIN, launcher=None, options="inflight.engine.builtin_backend:options",
    protocol="inflight", protocol_module="inflight.trainer.weight_sync.inflight",
    adapter="inflight.actor.response_parsers:parse_builtin", quick_start=True, restartable=True, ray=True))
