"""The weight-update contract's routes (docs/inference-contract.md): /init_process_group, /request_weight_update
and the optional dry run /check_weight_update, as a FastAPI router over a receiver (the built-in engine's
`WeightReceiver`, the vLLM backend's `VLLMWeightReceiver`), behind the API key and local-only unless allowed."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request

from inflight.transport.schemas import InitProcessGroupRequest, WeightUpdateRequest
from inflight.engine.api.guards import check_master_address
from inflight.engine.api.http_errors import Auth, BadRequest
from inflight.engine.api.metrics import ServerMetrics
from inflight.engine.weights.ipc_receiver import ipc_local_only  # cuda_ipc: handles from this host only
from inflight.engine.weights.receiver import WeightUpdateError

log = logging.getLogger("inflight.engine.api.server")


def weights_router(receiver: Any, auth: Auth, *, limits: Any = None, own_port: int | None = None,
                   metrics: ServerMetrics | None = None) -> APIRouter:
    """The weight routes over `receiver` (`init_process_group(req, connect_to)`, `update(req)`, `validate(req)`).
    A process group's master must be an address this server may connect to (`own_port`, the port we listen on, may
    not be named; guards.check_master_address), and the receiver connects to the address checked.
    `limits`: an engine whose parameter count caps an update's `params` list before it is validated (413).
    `metrics`: gets each applied update's pause (the receiver's answer's `pause_s`)."""
    router = APIRouter(dependencies=[Depends(auth.key), Depends(auth.admin)])

    async def update_limits(request: Request) -> None:
        """A valid update names each parameter at most once: refuse longer lists before they are validated."""
        if limits is None:
            return
        try:
            body = await request.json()
        except Exception:
            return  # malformed JSON: the body validation answers 400 with the parser's message
        params = body.get("params") if isinstance(body, dict) else None
        # tied aliases count: a list naming them too gets the 400 that names the canonical name, not a 413
        cap = len(limits.param_specs()) + len(getattr(limits, "tied_aliases", None) or {})
        if isinstance(body, dict) and body.get("adapter") is not None:
            cap *= 2  # an adapter update names two tensors (lora_A, lora_B) per adapted weight
        if isinstance(params, list) and len(params) > cap:
            raise HTTPException(413, f"'params' lists {len(params)} tensors; the model has {cap} parameters")

    @router.post("/init_process_group")
    async def init_process_group(req: InitProcessGroupRequest, request: Request) -> dict[str, Any]:
        client = request.client.host if request.client else ""
        try:  # getaddrinfo blocks: off the event loop
            connect_to = await asyncio.to_thread(check_master_address, req.master_address, req.master_port, client,
                                                 own_port)
        except ValueError as e:
            log.warning("403 /init_process_group from %s: %s", client, e)
            raise BadRequest(str(e), "master_address", status=403) from e
        try:
            return await receiver.init_process_group(req, connect_to=connect_to)
        except WeightUpdateError as e:
            raise BadRequest(str(e), status=e.status) from e
        except Exception as e:  # rendezvous failed (timeout, unreachable store)
            raise BadRequest(f"could not join the process group: {e}", status=500) from e

    @router.post("/request_weight_update", dependencies=[Depends(update_limits), Depends(ipc_local_only)])
    async def request_weight_update(req: WeightUpdateRequest) -> dict[str, Any]:
        try:
            done = await receiver.update(req)
        except WeightUpdateError as e:
            log.warning("weight update v%d rejected: %s", req.version, e)
            raise BadRequest(str(e), status=e.status) from e
        except Exception as e:  # a receiver's own failure: the contract's error shape, not a bare 500
            log.exception("weight update v%d failed", req.version)
            raise BadRequest(f"weight update failed: {e}", status=500) from e
        if metrics is not None and done.get("applied", True):  # a retry already held answers applied: false
            metrics.weight_update(float(done.get("pause_s", 0.0)))
        return done

    @router.post("/check_weight_update", dependencies=[Depends(update_limits), Depends(ipc_local_only)])
    async def check_weight_update(req: WeightUpdateRequest) -> dict[str, Any]:
        """Optional dry run: the checks /request_weight_update makes before receiving anything (the version rule, the
        announcement or a file's header, a segment's header), nothing received or changed."""
        try:  # reads a file's or a segment's header: off the event loop
            await asyncio.to_thread(receiver.validate, req)
        except WeightUpdateError as e:
            raise BadRequest(str(e), status=e.status) from e
        return {"ok": True}

    return router
