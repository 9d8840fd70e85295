"""`inflight serve`: the built-in engine behind the HTTP contract (docs/inference-contract.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

from inflight import backends
from inflight.config.engine import add_flags, from_args
from inflight.engine.api.chat_template import ChatTemplateError, TemplateAbilities, read_chat_template
from inflight.process import free_port


# `inflight serve` options that are not settings (EngineSettings, config/engine.py: every other option is one)
SERVE_ONLY = ("model", "engine", "host", "port", "device", "adapter", "log_level")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="folder of an HF causal LM (AutoModelForCausalLM)")
    p.add_argument("--engine", default=backends.BUILTIN, choices=backends.names(),
                   help=f"{backends.names_text()} (run from that engine's environment; other options go to "
                        "the engine; docs/backends.md)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--adapter", default=None,
                   help="folder of a saved PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors): "
                        "served merged into the model; adapter updates replace it (docs/inference-contract.md)")
    p.add_argument("--log-level", default="info")
    add_flags(p)  # the settings, one option per field


def strip_engine_flag(argv: list[str]) -> list[str]:
    """`inflight serve --engine X ...` -> the same arguments without `--engine X` (for another engine's launcher)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--engine":
            skip = True
        elif not a.startswith("--engine="):
            out.append(a)
    return out


def run(args: argparse.Namespace) -> int:
    backend = backends.get(args.engine)
    if backend.launcher is not None and args.adapter:
        raise SystemExit(f"--adapter is for the built-in engine; with --engine {args.engine}, push the adapter as an "
                         "update once the server is up (docs/inference-contract.md, \"Adapter updates\")")
    if backend.launcher is not None:  # the backend's own launcher takes every argument but --engine
        return int(backends.resolve(backend.launcher)(strip_engine_flag(args.raw_argv)) or 0)
    serve_app(build_app(args), args)
    return 0


def build_app(args: argparse.Namespace):
    """The built-in engine and its FastAPI app, from `inflight serve` arguments."""
    from inflight.engine.core import InferenceEngine  # lazy: start-up cost (torch, transformers) of `serve --help`
    from inflight.engine.api.server import create_app  # lazy: start-up cost (FastAPI, torch) of `serve --help`

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = from_args(args)
    except ValueError as e:
        raise SystemExit(f"inflight serve: {e}") from None
    try:  # before the model loads: a wrong path fails at once
        template = read_chat_template(settings.chat_template) if settings.chat_template else None
    except (ChatTemplateError, OSError) as e:
        raise SystemExit(f"inflight serve --chat-template: {e}") from None
    engine = InferenceEngine(args.model, settings, device=args.device)
    if template is not None:
        engine.tokenizer.chat_template = template
    can = TemplateAbilities.of(engine.tokenizer, settings.tool_call_parser)
    logging.getLogger("inflight.engine.api.server").info(
        "chat template: tools %s, tool calls in messages %s, tool-call parser %s",
        "rendered" if can.renders_tools else "not rendered", "rendered" if can.renders_tool_calls else "not rendered",
        can.parser)
    app = create_app(engine, settings, device=args.device, own_port=args.port)
    if getattr(args, "adapter", None):
        from inflight.modelkit.peft_adapter import read_peft_adapter  # lazy: only with --adapter

        try:
            adapter = read_peft_adapter(args.adapter)
            app.state.receiver.adapt_before_start(adapter.tensors, adapter.rank, adapter.scaling)
        except ValueError as e:  # a clear message, not a traceback (WeightUpdateError is a ValueError)
            raise SystemExit(f"inflight serve --adapter {args.adapter}: {e}") from None
    return app


def serve_app(app, args: argparse.Namespace) -> None:
    import uvicorn  # lazy: start-up cost (0.3 s) of `serve --help`

    from inflight.engine.api.http_server import uvicorn_config  # lazy: imports uvicorn

    server = uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           header_timeout_s=args.header_timeout_s))
    server.run()
    if not server.started:  # as uvicorn.run: the port was taken, or the app failed to start
        raise SystemExit(3)


class ServerProcess:
    """`inflight serve` in a subprocess (tests, the pipeline launcher): `.url`, `.stop()`, context manager. The server
    runs in its own session and is stopped as a process group (a backend may start children of its own)."""

    name = "inflight serve"

    def __init__(self, model: str, *, port: int = 0, host: str = "127.0.0.1", extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 120.0, log_path: str | None = None,
                 command: list[str] | None = None):
        import httpx  # lazy: start-up cost (0.1 s) of `serve --help`, which imports this module

        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path or tempfile.mktemp(prefix=f"inflight-serve-{self.port}-", suffix=".log")
        cmd = [*(command or [sys.executable, "-m", "inflight.cli", "serve"]), "--model", str(model), "--host", host,
               "--port", str(self.port), *(extra_args or [])]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} not healthy after {startup_timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 40) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `timeout_s`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
