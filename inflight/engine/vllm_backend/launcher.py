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
import os
import sys
from typing import Any

from fastapi import Depends, HTTPException, Request
from fastapi.responses import PlainTextResponse

from inflight.contracts import InitProcessGroupRequest, WeightUpdateRequest

WORKER_EXT = "inflight.engine.vllm_backend.worker_ext.InflightWorkerExtension"
SUPPORTED = ((0, 32), (0, 34))  # [min, max) vLLM minor versions; see docs/backends.md
DEFAULTS = [("--enable-prefix-caching", "--no-enable-prefix-caching"),
            ("--logprobs-mode", "--logprobs-mode=processed_logprobs"), ("--max-logprobs", "--max-logprobs=20")]

log = logging.getLogger("inflight.vllm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="folder of an HF causal LM with *.safetensors")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the folder's name)")
    p.add_argument("--api-key", default=os.environ.get("INFLIGHT_API_KEY") or None)
    p.add_argument("--allow-remote-admin", action="store_true")
    p.add_argument("--log-level", default="info")
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
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

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


def build_app(engine: Any, receiver: Any, *, api_key: str | None, allow_remote_admin: bool) -> Any:
    """inflight's app (OpenAI API + extensions) with the admin routes served by `receiver` (the workers)."""
    from inflight.engine.server import LOCAL_HOSTS, BadRequest, create_app, prometheus_text
    from inflight.engine.weight_receiver import WeightUpdateError

    app = create_app(engine, api_key=api_key, allow_remote_admin=allow_remote_admin, max_n=engine.max_batch)
    replaced = {"/init_process_group", "/request_weight_update", "/check_weight_update", "/metrics"}
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in replaced]

    async def auth(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization", "") != f"Bearer {api_key}":
            log.warning("401 %s from %s", request.url.path, request.client.host if request.client else "?")
            raise HTTPException(401, "missing or invalid API key (send 'Authorization: Bearer KEY')")

    async def admin(request: Request) -> None:
        host = request.client.host if request.client else ""
        if not allow_remote_admin and host not in LOCAL_HOSTS:
            log.warning("403 %s from %s: admin endpoints are local-only", request.url.path, host)
            raise HTTPException(403, "admin endpoints accept local clients only (serve --allow-remote-admin)")

    @app.post("/init_process_group", dependencies=[Depends(auth), Depends(admin)])
    async def init_process_group(req: InitProcessGroupRequest) -> dict[str, Any]:
        try:
            return await receiver.init_process_group(req)
        except WeightUpdateError as e:
            raise BadRequest(str(e), status=e.status) from e
        except Exception as e:
            raise BadRequest(f"could not join the process group: {e}", status=500) from e

    @app.post("/request_weight_update", dependencies=[Depends(auth), Depends(admin)])
    async def request_weight_update(req: WeightUpdateRequest) -> dict[str, Any]:
        try:
            return await receiver.update(req)
        except WeightUpdateError as e:
            log.warning("weight update v%d rejected: %s", req.version, e)
            raise BadRequest(str(e), status=e.status) from e
        except Exception as e:
            log.exception("weight update v%d failed", req.version)
            raise BadRequest(f"weight update failed: {e}", status=500) from e

    @app.post("/check_weight_update", dependencies=[Depends(auth), Depends(admin)])
    async def check_weight_update(req: WeightUpdateRequest) -> dict[str, Any]:
        try:
            receiver.validate(req)
        except WeightUpdateError as e:
            raise BadRequest(str(e), status=e.status) from e
        return {"ok": True}

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(engine.stats(), receiver.updates))

    return app


async def serve(args: argparse.Namespace, vllm_argv: list[str]) -> None:
    import uvicorn

    try:
        import vllm
    except ImportError as e:
        raise SystemExit(f"--engine vllm needs vLLM in this Python environment ({e}); run inflight from vLLM's "
                         "environment (pip install --no-deps -e . there; docs/backends.md)") from e
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from inflight.engine.vllm_backend.engine import VLLMEngine
    from inflight.engine.vllm_backend.receiver import VLLMWeightReceiver, checkpoint_specs

    check_vllm_version(vllm.__version__)
    llm = AsyncLLM.from_engine_args(engine_args(args.model, vllm_argv), usage_context=UsageContext.OPENAI_API_SERVER)
    engine = VLLMEngine(llm, args.model, model_name=args.served_model_name)
    await llm.update_weight_version("0")
    info = (await llm.collective_rpc("inflight_model_info"))[0]
    receiver = VLLMWeightReceiver(engine, checkpoint_specs(args.model, info["dtype"], tied=info["tied"]),
                                  device=info["device"], staging=args.weight_staging, tied=info["tied"])
    log.info("vLLM %s engine up: %s, dtype %s on %s, max_model_len %d", vllm.__version__, engine.model_name,
             info["dtype"], info["device"], engine.max_model_len)
    app = build_app(engine, receiver, api_key=args.api_key, allow_remote_admin=args.allow_remote_admin)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            backlog=4096, timeout_keep_alive=30)
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
