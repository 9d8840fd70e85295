"""TEST-ONLY vLLM plugin: a `gloo` weight-transfer backend for stock vLLM servers on CPU.

vLLM 0.32 picks the worker's weight-transfer engine by name from `WeightTransferEngineFactory`, a registry open to
`register_engine(name, cls)`, and `--weight-transfer-config` accepts any registered name. Every vLLM process (API
server, engine core, workers) runs the `vllm.general_plugins` entry points at start-up, so `register()` below makes
`--weight-transfer-config '{"backend": "gloo"}'` work on an unmodified server. All its built-in backends need CUDA.

Wire protocol (the one `trainer.protocol=vllm` speaks with `packed=false`):
- /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset, world_size, packed}}: each
  worker joins a gloo group as rank `rank_offset + its global rank`; the trainer is rank 0 and hosts the TCPStore.
  Store keys live under `<group_name>/cpu/`, the layout of `torch.distributed`'s own group construction.
- /update_weights {"update_info": {names, dtype_names, shapes}}: one gloo broadcast from rank 0 per name, in order.
- /start_weight_update and /finish_weight_update wrap the loads in vLLM's layerwise reload (as its NCCL backend
  does), which re-runs the CPU weight prepacking once each layer is complete.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    group_name: str = "weight_transfer"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.packed:
            raise ValueError("the gloo backend receives one broadcast per tensor: send packed=false")
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} outside 1..world_size-1 ({self.world_size})")


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")
        for d in self.dtype_names:
            if not isinstance(getattr(torch, d, None), torch.dtype):
                raise ValueError(f"unknown dtype name {d!r}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pg: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, is_master=False,
                         timeout=timeout)
        prefixed = PrefixStore("cpu/", PrefixStore(f"{init_info.group_name}/", store))
        self.pg = ProcessGroupGloo(prefixed, rank, init_info.world_size, timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which has no device to sync on CPU
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.pg is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
            self.pg.broadcast([weight], opts).wait()
            self.model.load_weights([(name, weight)])

    def shutdown(self) -> None:
        self.pg = None


def register() -> None:
    """The `vllm.general_plugins` entry point; runs once per vLLM process, possibly more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
