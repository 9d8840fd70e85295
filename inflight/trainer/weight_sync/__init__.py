"""Weight-update clients, one per server protocol (`trainer.protocol`), all with WeightSyncClient's surface:
`init_process_group()`, `push(named_tensors, version, mode="keep") -> stats`, `close()`, `world_size`.

    inflight  inflight's contract (docs/inference-contract.md): WeightSyncClient (inflight.py; transports:
              process_group over gloo or NCCL, shm, file)
    vllm      a stock vLLM server's native weight-transfer API (vllm.py); with trainer.lora, vLLM's own runtime
              LoRA loading, one adapter name per version (vllm_lora.py)
    sglang    a stock SGLang server's distributed weight update API (sglang.py)

Which module serves which trainer.protocol is the backends' registry's (inflight/backends.py): each protocol module
has `make_client(cfg, server_urls, common)` and `check_config(cfg)`.
"""

from __future__ import annotations

from typing import Any

from inflight.backends import protocol_module, resolve
from inflight.config import RunConfig


def protocol_of(cfg: RunConfig) -> Any:
    """The module of `cfg.trainer.protocol`'s client (a ValueError naming the known ones if there is none)."""
    return resolve(protocol_module(cfg.trainer.protocol))


def make_weight_sync(cfg: RunConfig, server_urls: list[str]) -> Any:
    """The weight client `cfg.trainer.protocol` names, configured from the run config."""
    module, t = protocol_of(cfg), cfg.trainer
    common = dict(api_key=cfg.server.api_key or None, master_address=cfg.pipeline.weight_sync_host,
                  master_port=cfg.pipeline.weight_sync_port, dtype=cfg.server.dtype, device=t.device,
                  backend=weight_backend(t.weight_backend, t.device))
    return module.make_client(cfg, server_urls, common)


def check_protocol_config(cfg: RunConfig) -> None:
    """The protocol's own checks of the run config (e.g. trainer.lora with a stock server), at config time
    (pipeline/launch_common.py) and again by the factory."""
    protocol_of(cfg).check_config(cfg)


def require_process_group(cfg: RunConfig) -> None:
    """Stock-server protocols receive over a process group only."""
    t = cfg.trainer
    if t.weight_transport != "process_group":
        raise ValueError(f"trainer.protocol={t.protocol} sends weights over a process group only "
                         f"(trainer.weight_transport={t.weight_transport!r})")


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
