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
from inflight.engine.chat_template import ChatTemplateError, TemplateAbilities, read_chat_template
from inflight.engine.tool_parser import PARSERS
from inflight.host import free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="folder of an HF causal LM (AutoModelForCausalLM)")
    p.add_argument("--engine", default=backends.BUILTIN, choices=backends.names(),
                   help=f"{backends.names_text()} (run from that engine's environment; other options go to "
                        "the engine; docs/backends.md)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--generator-precision", default="float32",
                   choices=["float32", "bfloat16", "bfloat16-fp32-head", "int8"],
                   help="what the forward computes with; updates still arrive in --dtype (engine/precision.py)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--max-batch", type=int, default=128, help="sequences decoded together")
    p.add_argument("--max-model-len", type=int, default=512, help="context length (prompt + completion)")
    p.add_argument("--max-tokens-per-step", type=int, default=4096, help="token budget of one engine step")
    p.add_argument("--low-priority-prefill", type=int, default=256,
                   help="prefill tokens per engine step for requests of priority > 0 (held-out evaluation), so "
                        "they never make a long step that rollouts and weight updates wait for")
    p.add_argument("--low-priority-seqs", type=int, default=0,
                   help="sequences of priority > 0 running at once (0: no limit), so evaluation decodes do not "
                        "lengthen every step that rollouts and weight updates wait for")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--prefix-reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="keep finished sequences' KV in free slots; a prompt that continues one (a multi-turn "
                        "episode's next turn) prefills only the rest (engine/prefix_cache.py)")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="decode steps replayed as CUDA graphs, one per batch bucket (auto: on a CUDA device; on: "
                        "also on CPU, run eagerly, for checks; docs/backends.md)")
    p.add_argument("--api-key", default=os.environ.get("INFLIGHT_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (env INFLIGHT_API_KEY)")
    p.add_argument("--allow-remote-admin", action="store_true",
                   help="accept /init_process_group and /request_weight_update from non-local clients")
    p.add_argument("--max-waiting", type=int, default=-1,
                   help="sequences that may wait beyond --max-batch; more get HTTP 429 (default -1: no limit)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger request bodies get HTTP 413")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="a connection whose request headers are not complete in this time is closed")
    p.add_argument("--body-timeout-s", type=float, default=30.0,
                   help="a request body not received in this time gets HTTP 408 and its connection closed")
    p.add_argument("--reject-nonfinite", action=argparse.BooleanOptionalAction, default=True,
                   help="refuse weight updates holding NaN/Inf (checked after receiving, before applying)")
    p.add_argument("--version-wait-s", type=float, default=300.0,
                   help="a request whose min_weight_version is not reached in this time gets HTTP 409")
    p.add_argument("--adapter", default=None,
                   help="folder of a saved PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors): "
                        "served merged into the model; adapter updates replace it (docs/inference-contract.md)")
    p.add_argument("--chat-template", default=None,
                   help="render chat messages with this template instead of the model's: a Jinja file, or a shipped "
                        "one by name (chatml_tools: ChatML with a Hermes tools section; docs/inference-contract.md)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *PARSERS],
                   help="read tool calls out of chat replies when a request has tools (auto: hermes when the chat "
                        "template writes <tool_call>, else none)")
    p.add_argument("--log-level", default="info")


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
    from inflight.engine.server import create_app  # lazy: start-up cost (FastAPI, torch) of `serve --help`

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = getattr(args, "tool_call_parser", "auto")
    spec = getattr(args, "chat_template", None)
    try:  # before the model loads: a wrong path fails at once
        template = read_chat_template(spec) if spec else None
    except (ChatTemplateError, OSError) as e:
        raise SystemExit(f"inflight serve --chat-template: {e}") from None
    engine = InferenceEngine(args.model, dtype=args.dtype, device=args.device, max_batch=args.max_batch,
                             max_model_len=args.max_model_len, max_tokens_per_step=args.max_tokens_per_step,
                             threads=args.threads, generator_precision=args.generator_precision,
                             prefix_reuse=getattr(args, "prefix_reuse", True),
                             cuda_graphs=getattr(args, "cuda_graphs", "auto"),
                             low_priority_prefill=getattr(args, "low_priority_prefill", 256),
                             low_priority_seqs=getattr(args, "low_priority_seqs", 0))
    if template is not None:
        engine.tokenizer.chat_template = template
    can = TemplateAbilities.of(engine.tokenizer, parser)
    logging.getLogger("inflight.engine.server").info(
        "chat template: tools %s, tool calls in messages %s, tool-call parser %s",
        "rendered" if can.renders_tools else "not rendered", "rendered" if can.renders_tool_calls else "not rendered",
        can.parser)
    app = create_app(engine, api_key=args.api_key, allow_remote_admin=args.allow_remote_admin, device=args.device,
                     max_waiting=None if args.max_waiting < 0 else args.max_waiting,
                     max_body_bytes=args.max_body_bytes, reject_nonfinite=args.reject_nonfinite, own_port=args.port,
                     version_wait_s=args.version_wait_s, tool_call_parser=parser,
                     body_timeout_s=getattr(args, "body_timeout_s", 30.0))
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

    from inflight.engine.http_server import uvicorn_config  # lazy: imports uvicorn

    server = uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           header_timeout_s=getattr(args, "header_timeout_s", 10.0)))
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
