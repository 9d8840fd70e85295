"""Weight-update clients, one per server protocol (`trainer.protocol`), all with WeightSyncClient's surface:
`init_process_group()`, `push(named_tensors, version, mode="keep") -> stats`, `close()`, `world_size`.

    inflight  inflight's contract (docs/inference-contract.md): WeightSyncClient, inflight/trainer/weight_sync.py
    vllm      a stock vLLM server's native weight-transfer API (vllm.py)
    sglang    a stock SGLang server's distributed weight update API (sglang.py)
"""

from __future__ import annotations

from typing import Any

PROTOCOLS = ("inflight", "vllm", "sglang")


def make_weight_sync(cfg: Any, server_urls: list[str]) -> Any:
    """The weight client `cfg.trainer.protocol` names, configured from the run config."""
    protocol = cfg.trainer.protocol
    common = dict(api_key=cfg.server.api_key or None, master_address=cfg.pipeline.weight_sync_host,
                  master_port=cfg.pipeline.weight_sync_port, dtype=cfg.server.dtype,
                  backend="nccl" if cfg.trainer.device.startswith("cuda") else "gloo")
    if protocol == "inflight":
        from inflight.trainer.weight_sync import WeightSyncClient

        return WeightSyncClient(server_urls, transport=cfg.trainer.weight_transport,
                                bucket_bytes=int(cfg.trainer.weight_bucket_mb * 2**20), **common)
    if cfg.trainer.weight_transport != "process_group":
        raise ValueError(f"trainer.protocol={protocol} sends weights over a process group only "
                         f"(trainer.weight_transport={cfg.trainer.weight_transport!r})")
    if protocol == "vllm":
        from inflight.trainer.protocols.vllm import VLLMWeightSync

        common.pop("backend")  # vLLM's own NCCL communicator
        return VLLMWeightSync(server_urls, **common)
    if protocol == "sglang":
        from inflight.trainer.protocols.sglang import SGLangWeightSync

        return SGLangWeightSync(server_urls, **common)
    raise ValueError(f"unknown trainer.protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
