"""`inflight serve --engine vllm --model DIR [vLLM engine options]` (or `python -m inflight.engine.vllm_backend`):
vLLM's engine (`AsyncLLM`, with our worker extension) behind the inflight contract.

Arguments we do not know are vLLM's engine arguments (`--dtype`, `--max-model-len`, `--tensor-parallel-size`,
`--gpu-memory-utilization`, ...), parsed by vLLM's own parser. Defaults we add unless given: no prefix caching (a
cached prefix computed by old weights would break "a request after an update uses only the new weights"),
`--logprobs-mode processed_logprobs` (logprobs of the distribution actually sampled from, the contract's μ), and
`--max-logprobs 20`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from inflight.config.engine import EngineSettings, add_flags, from_args

WORKER_EXT = "inflight.engine.vllm_backend.worker_ext.InflightWorkerExtension"
SUPPORTED = ((0, 32), (0, 34))  # [min, max) vLLM minor versions; see docs/backends.md
DEFAULTS = [("--enable-prefix-caching", "--no-enable-prefix-caching"),
            ("--logprobs-mode", "--logprobs-mode=processed_logprobs"), ("--max-logprobs", "--max-logprobs=20")]

# the settings (config/engine.py) this launcher takes as `inflight serve` does: our app's over vLLM
SETTINGS = ("api_key", "allow_remote_admin", "header_timeout_s", "body_timeout_s", "chat_template", "tool_call_parser")

log = logging.getLogger("inflight.vllm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="folder of an HF causal LM with *.safetensors")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the folder's name)")
    p.add_argument("--log-level", default="info")
    add_flags(p, SETTINGS)
    p.add_argument("--weight-staging", choices=("host", "device"), default="host", help=(
        "GPU workers: stage a broadcast update in pinned host memory, received through one bucket-sized GPU buffer "
        "(default), or on the GPU (a shorter pause; needs the model's size free: lower --gpu-memory-utilization)"))


def check_vllm_version(version: str) -> None:
    parts = version.split("+")[0].split(".")
    try:
        mm = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return
    lo, hi = SUPPORTED
    if not lo <= mm < hi:
        raise SystemExit(f"vLLM {version} is not supported: need >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]} "
                         "(docs/backends.md says why)")


def engine_args(model: str, vllm_argv: list[str]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs  # lazy: vLLM is optional (its own environment)
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # lazy: vLLM is optional

    given = {a.split("=")[0] for a in vllm_argv if a.startswith("--")}
    given |= {"--enable-prefix-caching"} if "--no-enable-prefix-caching" in given else set()
    extra = [dflt for flag, dflt in DEFAULTS if flag not in given]
    p = FlexibleArgumentParser()
    p = AsyncEngineArgs.add_cli_args(p)
    ns = p.parse_args([*extra, *vllm_argv, "--model", model])
    args = AsyncEngineArgs.from_cli_args(ns)
    if args.worker_extension_cls and args.worker_extension_cls != WORKER_EXT:
        raise SystemExit(f"--worker-extension-cls must be {WORKER_EXT} (the inflight contract needs it)")
    args.worker_extension_cls = WORKER_EXT
    return args


def build_app(engine: Any, receiver: Any, settings: EngineSettings, *, own_port: int | None = None) -> Any:
    """inflight's app over vLLM: the built-in server's OpenAI and health routers over `engine`, its weight router
    over `receiver` (the workers), behind the same access rules (server.py) by the same `settings` (those in
    SETTINGS come from the command line), the process-group master rule included (`own_port`: the port this server
    listens on, which may not be named as a master port)."""
    from inflight.engine.api.guards import Admission  # lazy: start-up cost (FastAPI, torch), not paid by `--help`
    from inflight.engine.api.http_errors import Auth  # lazy: start-up cost
    from inflight.engine.api.metrics import ServerMetrics  # lazy: start-up cost
    from inflight.engine.api.routes_health import health_router  # lazy: start-up cost
    from inflight.engine.api.routes_openai import openai_router  # lazy: start-up cost
    from inflight.engine.api.routes_weights import weights_router  # lazy: start-up cost
    from inflight.engine.api.server import base_app  # lazy: start-up cost

    app = base_app(engine, settings)
    admission = Admission(engine.max_batch, None)
    app.state.receiver, app.state.admission = receiver, admission
    auth = Auth(settings.api_key or None, settings.allow_remote_admin)
    metrics = ServerMetrics(engine, receiver, admission)
    app.include_router(openai_router(engine, admission, auth, max_n=engine.max_batch,
                                     tool_call_parser=settings.tool_call_parser, metrics=metrics))
    app.include_router(health_router(engine, auth, metrics))
    # a master address is vetted as on the built-in server (guards.check_master_address): the workers connect to
    # the address checked, never to a name resolved again
    app.include_router(weights_router(receiver, auth, own_port=own_port, metrics=metrics))
    return app


async def serve(args: argparse.Namespace, vllm_argv: list[str]) -> None:
    import uvicorn  # lazy: start-up cost, not paid by `--help` or a bad argument

    from inflight.engine.api.http_server import uvicorn_config  # lazy: imports uvicorn

    try:
        import vllm  # lazy: vLLM is optional (its own environment)
    except ImportError as e:
        raise SystemExit(f"--engine vllm needs vLLM in this Python environment ({e}); run inflight from vLLM's "
                         "environment (pip install --no-deps -e . there; docs/backends.md)") from e
    from vllm.usage.usage_lib import UsageContext  # lazy: vLLM is optional
    from vllm.v1.engine.async_llm import AsyncLLM  # lazy: vLLM is optional

    from inflight.engine.api.chat_template import ChatTemplateError, read_chat_template  # lazy: start-up cost
    from inflight.engine.vllm_backend.engine import VLLMEngine  # lazy: start-up cost (torch, transformers)
    from inflight.engine.vllm_backend.receiver import VLLMWeightReceiver, checkpoint_specs  # lazy: start-up cost

    check_vllm_version(vllm.__version__)
    try:  # before the model loads: a wrong path fails at once
        template = read_chat_template(args.chat_template) if args.chat_template else None
    except (ChatTemplateError, OSError) as e:
        raise SystemExit(f"inflight serve --engine vllm --chat-template: {e}") from None
    llm = AsyncLLM.from_engine_args(engine_args(args.model, vllm_argv), usage_context=UsageContext.OPENAI_API_SERVER)
    engine = VLLMEngine(llm, args.model, model_name=args.served_model_name)
    if template is not None:
        engine.tokenizer.chat_template = template
    await llm.update_weight_version("0")
    info = (await llm.collective_rpc("inflight_model_info"))[0]
    receiver = VLLMWeightReceiver(engine, checkpoint_specs(args.model, info["dtype"], tied=info["tied"]),
                                  device=info["device"], staging=args.weight_staging, tied=info["tied"])
    log.info("vLLM %s engine up: %s, dtype %s on %s, max_model_len %d", vllm.__version__, engine.model_name,
             info["dtype"], info["device"], engine.max_model_len)
    app = build_app(engine, receiver, from_args(args, SETTINGS), own_port=args.port)
    config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level,
                            header_timeout_s=args.header_timeout_s)
    await uvicorn.Server(config).serve()


def run(args: argparse.Namespace, vllm_argv: list[str]) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args, vllm_argv))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="inflight serve --engine vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args, vllm_argv = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    return run(args, vllm_argv)
