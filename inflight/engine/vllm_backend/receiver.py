"""The weight-update contract (docs/inference-contract.md §4) on top of vLLM: validation here, in the API process,
against the checkpoint's names and shapes and the served dtype; the transfer itself in the workers
(worker_ext.py), driven with `collective_rpc`.

An update: validate (400/409 before anything is received) → [file / shm: each worker reads it or maps the segment
(shm: once the trainer has completed it, `wait_shm`) and checks it for NaN/Inf while generation continues] → `pause_generation(mode="keep")` (the engine stops between
two steps; requests keep their KV cache) → workers receive the broadcasts (staged, checked for NaN/Inf) and load
them all at once → interrupt mode: `reset_prefix_cache(
reset_running_requests=True)` preempts every running request, so its KV cache is recomputed with the new weights
(prompt + tokens so far) before its next token → the engine's weight version is set (every later step's tokens
carry it) → `resume_generation()`. An adapter update (`adapter` set) is checked with check_adapter, and the
workers merge W0 + s * B @ A into the staged weights (file / shm: before the pause; broadcasts: after receiving, in
it) and load those like a full update. A NaN or Inf in the update is a 400 and nothing is applied (the workers check
what they staged, one fused reduction each; an adapter's merged weights too, which finite A and B can overflow).
A version older than the one served is a 409 (update_checks.check_version). A join holds no lock while the workers
wait for the rendezvous: file and shm updates go on meanwhile, and a newer join supersedes it (409 for the older). A tied model's shared tensor is announced once, under the embedding's
name (`model.embed_tokens.weight`); `lm_head.weight` is then not a parameter of the model here (400, like an alias
to the built-in server).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import time
from typing import Any

import torch

from inflight.transport.schemas import InitProcessGroupRequest, ParamInfo, WeightUpdateRequest

from inflight.transport.layout import bucket_layout, packed_bytes, shm_layout
from inflight.engine.vllm_backend.worker_ext import NONFINITE
from inflight.engine.weights.checks import (DTYPES, WeightUpdateError, check_adapter, check_params, check_shm,
                                           check_version, file_params, safetensors_header, wait_shm)

log = logging.getLogger("inflight.vllm.weights")


def checkpoint_specs(model_dir: str, dtype: str, tied: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model's parameters as HF names them (the checkpoint's tensors), in the served dtype. A tied model's head
    is the embedding: `lm_head.weight` is not one of them, even if the checkpoint holds a copy."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        for name, (shape, _) in safetensors_header(f).items():
            specs[name] = (tuple(shape), DTYPES[dtype])
    if not specs:
        raise RuntimeError(f"no *.safetensors in {model_dir}")
    if tied:
        specs.pop("lm_head.weight", None)
    return specs


class VLLMWeightReceiver:
    """Same interface as inflight.engine.weights.receiver.WeightReceiver (init_process_group, validate, update)."""

    def __init__(self, engine: Any, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: str,
                 staging: str = "host", tied: bool = False):
        self.engine, self.llm, self.specs, self.device = engine, engine.llm, specs, device
        self.aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}  # refused, named in the 400
        self.staging = staging  # GPU broadcasts: stage in pinned host memory (one bucket of GPU memory) or on the GPU
        self._lock = asyncio.Lock()  # one update at a time (a join does not take it: it waits for the rendezvous)
        self._joins = 0  # joins started: only the latest one may complete
        self.has_group = False
        self.updates = 0
        self.last_update: dict[str, Any] = {}

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        return await self.llm.collective_rpc(method, args=args)

    # ---- process group ----------------------------------------------------------------------------------------
    async def init_process_group(self, req: InitProcessGroupRequest, connect_to: str | None = None) -> dict[str, Any]:
        """`connect_to`: the checked IP of req.master_address (routes_weights vets the name first)."""
        if req.rank_offset >= req.world_size:
            raise WeightUpdateError(f"rank_offset {req.rank_offset} must be < world_size {req.world_size}")
        if req.backend == "nccl" and self.device == "cpu":
            raise WeightUpdateError("backend 'nccl' needs a CUDA device; this server runs on CPU (use 'gloo')")
        if self._lock.locked():
            raise WeightUpdateError("a weight update is in progress", status=409)
        self._joins += 1
        seq = self._joins
        self.has_group = False  # the workers let their group go as they start joining
        ranks = await self._rpc("inflight_join_group", connect_to or req.master_address, req.master_port,
                                req.rank_offset, req.world_size, req.backend, req.timeout_s)
        if max(ranks) >= req.world_size:
            raise WeightUpdateError(f"this server has {len(ranks)} ranks; rank_offset {req.rank_offset} + "
                                    f"{len(ranks)} exceeds world_size {req.world_size}")
        deadline = time.monotonic() + req.timeout_s
        while True:  # the workers join in a thread: generation, file and shm updates go on meanwhile
            if self._joins != seq:
                raise WeightUpdateError("superseded by a newer /init_process_group while waiting for the "
                                        "rendezvous; this join was given up", status=409)
            states = await self._rpc("inflight_group_status")
            errors = [s for s in states if s.startswith("error")]
            if errors:
                raise RuntimeError("; ".join(errors))
            if all(s == "ready" for s in states):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous not complete after {req.timeout_s}s")
            await asyncio.sleep(0.05)
        self.has_group = True
        log.info("weight group joined: ranks %s of %d via %s:%d (%s)", ranks, req.world_size, req.master_address,
                 req.master_port, req.backend)
        return {"rank": req.rank_offset, "world_size": req.world_size, "backend": req.backend}

    # ---- updates ----------------------------------------------------------------------------------------------
    def _check(self, params: list[ParamInfo], req: WeightUpdateRequest) -> None:
        if req.adapter is not None:  # merged in the workers: W0 + s * B @ A (worker_ext.inflight_merge_staged)
            check_adapter(params, req.adapter, self.specs, self.aliases)
        else:
            check_params(params, self.specs, self.aliases)

    def validate(self, req: WeightUpdateRequest) -> None:
        check_version(req.version, self.engine.version, req.new_run)
        if req.ipc is not None:
            raise WeightUpdateError("the vLLM backend does not take cuda_ipc updates (built-in engine only): use "
                                    "trainer.weight_transport=process_group or shm")
        if req.shm is not None:
            self._check(req.params or [], req)
            check_shm(req)
            return
        if req.params is not None:
            if not self.has_group:
                raise WeightUpdateError("no process group: POST /init_process_group first", status=409)
            self._check(req.params, req)
            return
        self._check(file_params(req.path or ""), req)

    async def update(self, req: WeightUpdateRequest) -> dict[str, Any]:
        await asyncio.to_thread(self.validate, req)  # may read a file's or a segment's header
        if self._lock.locked():
            raise WeightUpdateError("another weight update is in progress", status=409)
        async with self._lock:
            check_version(req.version, self.engine.version, req.new_run)  # again: one may have been applied meanwhile
            t0 = time.perf_counter()
            try:  # read (or mapped) and checked before pausing
                if req.path is not None:
                    await self._rpc("inflight_stage_file", req.path)
                elif req.shm is not None:
                    # again, under the lock, and until the trainer has written all of it: the workers map a
                    # complete segment of the announced version
                    await asyncio.to_thread(wait_shm, req)
                    offsets, _ = shm_layout(req.params or [])
                    await self._rpc("inflight_stage_shm", req.shm.path, [
                        [p.name, list(p.shape), p.dtype, off] for p, off in zip(req.params or [], offsets)])
                if req.adapter is not None and (req.path is not None or req.shm is not None):
                    await self._rpc("inflight_merge_staged", req.adapter.scaling)  # before the pause
            except Exception as e:
                raise _rejected(e) from None
            await self.llm.pause_generation(mode="keep", clear_cache=False)
            p0 = time.perf_counter()
            try:
                if req.params is not None and req.shm is None:
                    params = req.params
                    try:
                        await self._rpc("inflight_receive", [
                            [[[params[i].name, list(params[i].shape), params[i].dtype, offset] for i, offset in b],
                             packed_bytes(params, b)]
                            for b in bucket_layout(params, req.bucket_bytes)], self.staging)
                    except Exception as e:
                        raise _rejected(e) from None
                    if req.adapter is not None:  # broadcasts arrive inside the pause: so does their merge
                        try:
                            await self._rpc("inflight_merge_staged", req.adapter.scaling)
                        except Exception as e:
                            raise _rejected(e) from None
                await self._rpc("inflight_apply")
                if req.mode == "interrupt":
                    await self.llm.reset_prefix_cache(reset_running_requests=True)
                await self.llm.update_weight_version(str(req.version))
                self.engine.version = req.version
            except Exception:
                await self._rpc("inflight_drop_staged")
                raise
            finally:
                await self.llm.resume_generation()
                pause_s = time.perf_counter() - p0
                self.engine.paused_seconds += pause_s
        self.updates += 1
        self.last_update = {"version": req.version, "pause_s": pause_s, "seconds": time.perf_counter() - t0}
        log.info("weight update v%d (%s, mode=%s): paused %.3fs, total %.3fs", req.version,
                 "file" if req.path else "shm" if req.shm else f"broadcast of {len(req.params or [])} tensors",
                 req.mode, pause_s, time.perf_counter() - t0)
        return {"version": req.version, "pause_s": pause_s}


def _rejected(e: Exception) -> Exception:
    """A worker's NaN/Inf refusal is the client's fault (400, nothing applied); anything else stays as it is."""
    return WeightUpdateError(str(e)[str(e).find("weight update rejected"):]) if NONFINITE in str(e) else e
