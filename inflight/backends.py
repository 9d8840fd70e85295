"""The inference backends inflight can drive, by name (`server.engine`, `inflight serve --engine`), and what each
brings to every role: how its server starts (`inflight serve --engine NAME` hands its arguments to the backend's
launcher), how `server.*` maps onto its options, the weight-update protocol its servers speak (`trainer.protocol`,
the trainer's client) and the response adapter that reads its completions (`actor.adapter`).

This module sits on the second floor, above config (tests/test_layering.py): every role may ask it, and it imports no role. So a
registration holds *import paths* ("package.module:attribute"), and each role resolves only its own part, in its
own layer: the engine its launcher, the pipeline the option mapping, the trainer the protocol module, the actor the
adapter. A backend registers itself from its own folder (`register(InferenceBackend(...))`); the registry imports
those registration modules on first use: the three shipped ones, and every module named in the environment
variable INFLIGHT_BACKENDS (comma separated), which a run's processes inherit. Adding a backend is one folder and
one registration (docs/backends.md, "Adding a backend").
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inflight.config import RunConfig

BUILTIN = "builtin"  # the built-in engine: served in-process by `inflight serve`, the default of server.engine
ENV = "INFLIGHT_BACKENDS"
# registration modules of the shipped backends (each one a plain-data module in the backend's own folder)
SHIPPED = ("inflight.engine.builtin_backend", "inflight.engine.vllm_backend.backend",
           "inflight.engine.sglang_backend.backend")


@dataclass(frozen=True)
class InferenceBackend:
    """One backend. Paths are "module:attribute" (or a module for `protocol_module`), imported only by the role
    that needs them.

    name:            server.engine / `inflight serve --engine NAME`.
    launcher:        `main(argv) -> int` that `inflight serve --engine NAME` calls with its arguments (without
                     --engine); None: the built-in server, run by `inflight serve` itself.
    options:         `options(server_cfg, cuda: bool) -> list[str]`: server.* as the server's own command-line
                     options (the pipeline launcher appends server.extra_args after them).
    protocol:        the trainer.protocol name of the weight-update protocol its servers speak ...
    protocol_module: ... and the module of that protocol's client: `make_client(cfg, server_urls, common)` and
                     `check_config(cfg)` (trainer/weight_sync/).
    adapter:         `parse(response_json) -> list[Completion]` for actor.adapter=NAME (actor/response_parsers.py).
    quick_start:     up in seconds (pipeline.startup_timeout_s defaults to 180 s, else 600 s + 60 s per server).
    restartable:     pipeline.restart_servers may restart it behind the weight gate (pipeline/restart.py).
    """

    name: str
    launcher: str | None
    options: str
    protocol: str
    protocol_module: str
    adapter: str
    quick_start: bool = False
    restartable: bool = False
    ray: bool = False  # pipeline.launcher=ray may start it


_REGISTRY: dict[str, InferenceBackend] = {}
_LOADED: set[str] = set()
_LOCK = threading.RLock()


def register(backend: InferenceBackend) -> InferenceBackend:
    """Make `backend` known under its name (a name registered twice is an error: a silent override would hide a
    clash between two plugins)."""
    with _LOCK:
        old = _REGISTRY.get(backend.name)
        if old is not None and old != backend:
            raise ValueError(f"inference backend {backend.name!r} is registered twice")
        _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Forget a backend (tests that register one of their own)."""
    with _LOCK:
        _REGISTRY.pop(name, None)


def _load() -> None:
    extra = [m.strip() for m in os.environ.get(ENV, "").split(",") if m.strip()]
    with _LOCK:
        for module in (*SHIPPED, *extra):
            if module not in _LOADED:
                try:
                    importlib.import_module(module)
                except ImportError as e:
                    raise ValueError(f"{ENV} names {module!r}, which cannot be imported: {e}") from e
                _LOADED.add(module)


def names() -> list[str]:
    """Every registered backend's name, in registration order (the shipped ones first, the built-in one first)."""
    _load()
    return list(_REGISTRY)


def names_text() -> str:
    """"builtin, vllm or sglang": the names for an error message."""
    found = names()
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"


def get(name: str) -> InferenceBackend:
    _load()
    if name not in _REGISTRY:
        raise ValueError(f"unknown inference backend {name!r}; choose one of {names_text()} (another one: "
                         f"register it and name its module in {ENV}, docs/backends.md)")
    return _REGISTRY[name]


def protocols() -> dict[str, str]:
    """trainer.protocol name -> its client's module."""
    _load()
    return {b.protocol: b.protocol_module for b in _REGISTRY.values()}


def protocol_module(protocol: str) -> str:
    found = protocols()
    if protocol not in found:
        raise ValueError(f"unknown trainer.protocol {protocol!r}; choose one of {', '.join(found)}")
    return found[protocol]


def adapter_path(name: str) -> str:
    """The response adapter of actor.adapter=NAME (a backend's name)."""
    _load()
    if name not in _REGISTRY:
        raise ValueError(f"unknown response adapter '{name}'; choose one of {sorted(names())}")
    return _REGISTRY[name].adapter


def resolve(path: str) -> Any:
    """"package.module:attribute" -> the attribute; "package.module" -> the module."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def startup_timeout(cfg: RunConfig) -> float:
    """pipeline.startup_timeout_s, or when 0 a default for the engine: the built-in server is up in seconds; vLLM and
    SGLang compile kernels and capture CUDA graphs at start, slower when several servers do it at once."""
    if cfg.pipeline.startup_timeout_s > 0:
        return float(cfg.pipeline.startup_timeout_s)
    backend = get(cfg.server.engine)
    if backend.quick_start and cfg.trainer.protocol == backend.protocol:
        return 180.0
    servers = len(cfg.pipeline.server_urls) or cfg.server.num_servers
    return 600.0 + 60.0 * max(0, servers - 1)
