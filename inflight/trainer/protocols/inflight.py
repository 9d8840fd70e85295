"""`trainer.protocol: inflight`: inflight's own contract (docs/inference-contract.md), spoken by the built-in
engine and by `inflight serve --engine vllm`; the client is WeightSyncClient (weight_sync.py)."""

from __future__ import annotations

from typing import Any


def check_config(cfg: Any) -> None:
    """Every trainer setting works with the contract (adapter updates included)."""


def make_client(cfg: Any, server_urls: list[str], common: dict[str, Any]) -> Any:
    from inflight.trainer.weight_sync import WeightSyncClient

    t = cfg.trainer
    return WeightSyncClient(server_urls, transport=t.weight_transport, shm_dir=t.shm_dir, shm_lend=t.shm_lend,
                            bucket_bytes=int(t.weight_bucket_mb * 2**20), **common)
