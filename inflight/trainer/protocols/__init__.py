"""Weight-update clients, one per server protocol (`trainer.protocol`), all with WeightSyncClient's surface:
`init_process_group()`, `push(named_tensors, version, mode="keep") -> stats`, `close()`, `world_size`.

    inflight  inflight's contract (docs/inference-contract.md): WeightSyncClient, inflight/trainer/weight_sync.py
              (transports: process_group over gloo or NCCL, shm, file)
    vllm      a stock vLLM server's native weight-transfer API (vllm.py); with trainer.lora, vLLM's own runtime
              LoRA loading, one adapter name per version (vllm_lora.py)
    sglang    a stock SGLang server's distributed weight update API (sglang.py)
"""

from __future__ import annotations

from typing import Any

PROTOCOLS = ("inflight", "vllm", "sglang")


def make_weight_sync(cfg: Any, server_urls: list[str]) -> Any:
    """The weight client `cfg.trainer.protocol` names, configured from the run config."""
    protocol, t = cfg.trainer.protocol, cfg.trainer
    common = dict(api_key=cfg.server.api_key or None, master_address=cfg.pipeline.weight_sync_host,
                  master_port=cfg.pipeline.weight_sync_port, dtype=cfg.server.dtype, device=t.device,
                  backend=weight_backend(t.weight_backend, t.device))
    if protocol == "inflight":
        from inflight.trainer.weight_sync import WeightSyncClient

        return WeightSyncClient(server_urls, transport=t.weight_transport, shm_dir=t.shm_dir, shm_lend=t.shm_lend,
                                bucket_bytes=int(t.weight_bucket_mb * 2**20), **common)
    if getattr(t, "lora", None) is not None:
        check_stock_lora(cfg)
        return vllm_lora_client(cfg, server_urls)
    if t.weight_transport != "process_group":
        raise ValueError(f"trainer.protocol={protocol} sends weights over a process group only "
                         f"(trainer.weight_transport={t.weight_transport!r})")
    if protocol == "vllm":
        from inflight.trainer.protocols.vllm import VLLMWeightSync

        if t.weight_backend == "gloo":
            raise ValueError("trainer.protocol=vllm broadcasts with vLLM's own NCCL communicator (the server's "
                             "--weight-transfer-config backend); trainer.weight_backend=gloo is not available there")
        common.pop("backend")
        return VLLMWeightSync(server_urls, **common)
    if protocol == "sglang":
        from inflight.trainer.protocols.sglang import SGLangWeightSync

        return SGLangWeightSync(server_urls, **common)
    raise ValueError(f"unknown trainer.protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")


def check_stock_lora(cfg: Any) -> None:
    """trainer.lora with a stock-server protocol: vLLM's runtime LoRA loading; SGLang's is not supported (never run
    against a real SGLang). Called at config time (pipeline/launch_common.py) and by the factory."""
    protocol = cfg.trainer.protocol
    if protocol == "sglang":
        raise ValueError("trainer.lora with trainer.protocol=sglang is not supported (SGLang's /load_lora_adapter has "
                         "never run here); use trainer.protocol=vllm (stock vLLM with --enable-lora) or inflight")
    if protocol == "vllm" and cfg.pipeline.update_mode != "keep":
        raise ValueError("trainer.lora with trainer.protocol=vllm: pipeline.update_mode must be 'keep' (vLLM keeps a "
                         "running request on the adapter it started with; it cannot move it to newer weights)")
    if protocol == "vllm" and cfg.actor.adapter != "vllm":
        raise ValueError("trainer.lora with trainer.protocol=vllm needs actor.adapter=vllm (the actor asks for each "
                         "version's adapter by name)")


def vllm_lora_client(cfg: Any, server_urls: list[str]) -> Any:
    """The adapter client for stock vLLM servers: folders under trainer.lora.served_dir (default
    <run dir>/served_adapters), the last actor.max_lag + 2 versions loaded (a running group may use any of them)."""
    import os

    from inflight.trainer.protocols.vllm_lora import VLLMLoraSync, checkpoint_shapes

    lora = cfg.trainer.lora
    folder = lora.served_dir or os.path.join(cfg.pipeline.run_dir, cfg.name, "served_adapters")
    shapes = checkpoint_shapes(cfg.model.path) if os.path.isdir(cfg.model.path) else None
    return VLLMLoraSync(server_urls, folder, name=lora.served_name, keep=cfg.actor.max_lag + 2,
                        api_key=cfg.server.api_key or None, base_shapes=shapes or None, base_model=cfg.model.path)


def weight_backend(choice: str, device: str) -> str:
    """trainer.weight_backend: `auto` is NCCL on a CUDA trainer and gloo on CPU. A CUDA trainer may choose gloo
    (gloo broadcasts CUDA tensors through host memory): NCCL refuses two ranks on one GPU, so a trainer and a server
    sharing one GPU need gloo (or the shm / file transports)."""
    if choice == "auto":
        return "nccl" if str(device).startswith("cuda") else "gloo"
    if choice not in ("nccl", "gloo"):
        raise ValueError(f"trainer.weight_backend must be auto, nccl or gloo, not {choice!r}")
    if choice == "nccl" and not str(device).startswith("cuda"):
        raise ValueError(f"trainer.weight_backend=nccl needs a CUDA trainer (trainer.device={device!r}); use gloo")
    return choice
