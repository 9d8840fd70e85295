"""`trainer.protocol: sglang`: push weights to stock SGLang servers (`python -m sglang.launch_server`).

Routes (SGLang 0.5.x, `sglang/srt/managers/io_struct.py`):
    GET  /get_server_info                      tp_size: how many ranks each server adds to the group
    POST /init_weights_update_group            {master_address, master_port, rank_offset, world_size, group_name,
                                                backend}; the server's ranks join while we join as rank 0
    POST /pause_generation                     {"mode": "in_place"} (keep) or {"mode": "retract"} (interrupt:
                                                running requests go back to the queue and recompute their KV cache)
    POST /update_weights_from_distributed      {names, dtypes, shapes, group_name, flush_cache, weight_version};
                                                answered after every tensor was broadcast, one per name, in order
    POST /continue_generation                  {}
    POST /destroy_weights_update_group         {group_name} (close(); best effort)
SGLang answers {"success": bool, "message": str}; `success: false` is an error here.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any, Iterable

import torch

from inflight.config import RunConfig
from inflight.trainer.weight_sync import require_process_group
from inflight.trainer.weight_sync.common import DTYPE_NAMES, ProtocolClient, TorchGroup, WeightSyncError

log = logging.getLogger("inflight.trainer.weight_sync.sglang")

PAUSE_MODES = {"keep": "in_place", "interrupt": "retract"}


class SGLangWeightSync(ProtocolClient):
    protocol = "sglang"

    def __init__(self, server_urls: list[str], *, group_name: str = "weight_update_group", **kw):
        super().__init__(server_urls, **kw)
        self.group_name = group_name

    def init_process_group(self) -> None:
        self.ranks = [self._tp_size(u) for u in self.urls]
        offsets = self.rank_offsets()

        def body(i: int) -> dict:
            return {"master_address": self.master_address, "master_port": self.master_port,
                    "rank_offset": offsets[i], "world_size": self.world_size, "group_name": self.group_name,
                    "backend": self.backend}

        self.host_group(lambda: self.post_all("/init_weights_update_group", body),
                        lambda store: TorchGroup(store, self.world_size, self.backend, self.group_name,
                                                 _td(self.timeout_s), outer_prefix=self.group_name))
        log.info("sglang weight group up: %d servers, world %d (%s)", len(self.urls), self.world_size, self.backend)

    def _tp_size(self, url: str) -> int:
        try:
            info = self.request(url, "GET", "/get_server_info")
        except WeightSyncError:
            return 1  # an older server without the route: one rank
        return int(info.get("tp_size", 1)) * int(info.get("pp_size", 1))

    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int, mode: str = "keep") -> dict:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {sorted(PAUSE_MODES)}, not {mode!r}")
        t0 = time.perf_counter()
        tensors = self.convert(list(named_weights))
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        body = {"names": [n for n, _ in tensors], "dtypes": [DTYPE_NAMES[t.dtype] for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], "group_name": self.group_name,
                # in_place keeps running requests' KV cache, and SGLang refuses to flush it then
                "flush_cache": mode == "interrupt", "weight_version": str(version)}
        self.post_all("/pause_generation", {"mode": PAUSE_MODES[mode]})
        paused = time.perf_counter()
        try:
            self.broadcast_with("/update_weights_from_distributed", body, tensors)
        finally:
            self.post_all("/continue_generation", {})  # never leave the servers paused
        seconds = time.perf_counter() - t0
        pause = time.perf_counter() - paused
        log.info("pushed v%d to sglang: %d tensors, %.1f MB in %.3fs", version, len(tensors), nbytes / 1e6, seconds)
        return {"version": version, "bytes": nbytes, "seconds": seconds, "num_tensors": len(tensors),
                "pause_s": {u: pause for u in self.urls}}


    def close(self) -> None:
        if self.group is not None:  # let the servers leave the group too, so a later client can form it again
            try:
                self.post_all("/destroy_weights_update_group", {"group_name": self.group_name})
            except WeightSyncError as e:
                log.warning("could not destroy the weight group: %s", e)
        super().close()


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def check_config(cfg: RunConfig) -> None:
    if cfg.trainer.lora is not None:
        raise ValueError("trainer.lora with trainer.protocol=sglang is not supported (SGLang's /load_lora_adapter has "
                         "never run here); use trainer.protocol=vllm (stock vLLM with --enable-lora) or inflight")


def make_client(cfg: RunConfig, server_urls: list[str], common: dict[str, Any]) -> Any:
    check_config(cfg)
    require_process_group(cfg)
    return SGLangWeightSync(server_urls, **common)
