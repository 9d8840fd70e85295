"""Trainer side of the `cuda_ipc` transport (inflight/transport/cuda_ipc.py): copy the update into the trainer's shared
device buffer (allocated and exported once), then post the announcement with the buffer's handle to every server
on the device; each copies it into its weights at its next step boundary and answers. The buffer is written again
only after every server answered; after a failed push it is replaced, so a server still reading the old one never
sees it change."""

from __future__ import annotations

import time
from typing import Any

import torch

from inflight.transport.schemas import ParamInfo

from inflight.transport.layout import shm_layout
from inflight.transport.cuda_ipc import IpcError
from inflight.transport.shm import announcement_digest
from inflight.trainer.weight_sync.common import DTYPE_NAMES, WeightSyncError


def push_ipc(client: Any, tensors: list[tuple[str, torch.Tensor]], version: int, mode: str,
             extra: dict) -> list[dict]:
    """One push of `client` (a WeightSyncClient with transport cuda_ipc): its answers, one per server."""
    writer = client._ipc
    dtypes = [DTYPE_NAMES[client.dtype or t.dtype] for _, t in tensors]
    key = tuple((n, tuple(t.shape), d) for (n, t), d in zip(tensors, dtypes))
    params = [{"name": n, "shape": list(s), "dtype": d} for n, s, d in key]
    if getattr(writer, "layout", None) is None or writer.layout[0] != key:
        infos = [ParamInfo(**p) for p in params]
        writer.layout = (key, *shm_layout(infos), announcement_digest(infos))
    _, offsets, data_bytes, digest = writer.layout
    announced = ("cuda_ipc", mode, key, tuple(sorted(extra.get("adapter", {}).items())))
    try:
        t0 = time.perf_counter()
        try:
            handle = writer.write(tensors, dtypes, offsets, data_bytes, version, digest)
        except IpcError as e:
            raise WeightSyncError(str(e)) from None
        client.last_write_s = time.perf_counter() - t0
        body = {"version": version, "mode": mode, "params": params, "ipc": handle, **extra}
        if client.precheck and announced != client._accepted:
            client.collect([client.pool.submit(client.post, u, "/check_weight_update", body, True)
                             for u in client.urls], "check_weight_update")
        answers = client.collect([client.pool.submit(client.post, u, "/request_weight_update", body)
                                   for u in client.urls], "request_weight_update")
    except BaseException:
        writer.discard()  # a server may still read the old buffer: never write it again
        raise
    client._accepted = announced
    return answers
