"""Where each tensor of a weight update lies in the bytes that carry it: the buckets of a broadcast and the offsets in
a shared-memory segment, derived by both ends from the announcement alone; and which parameters share a tensor."""

from __future__ import annotations

from typing import Any

from inflight.transport.schemas import ParamInfo

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
BUCKET_ALIGN = 64  # bytes: every packed tensor starts at a multiple of this


def bucket_layout(params: list[ParamInfo], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """The broadcasts of a bucketed update, which both ends derive from the announcement: the tensors in announced
    order, each at the next multiple of BUCKET_ALIGN bytes of the current bucket, a new bucket whenever the next
    tensor would not fit in `bucket_bytes`. A bucket is [(param index, byte offset), ...]. A bucket of one tensor is
    broadcast as that tensor (its shape and dtype); a bucket of several as one flat uint8 buffer of
    `packed_bytes(...)` bytes. Many small tensors then cost one broadcast, large ones are never copied."""
    buckets: list[list[tuple[int, int]]] = []
    end = bucket_bytes  # the current bucket's used bytes (full: start a new one)
    for i, p in enumerate(params):
        start = -(-end // BUCKET_ALIGN) * BUCKET_ALIGN
        nbytes = _param_bytes(p)
        if not buckets or start + nbytes > bucket_bytes:
            buckets.append([])
            start = 0
        buckets[-1].append((i, start))
        end = start + nbytes
    return buckets


def shm_layout(params: list[ParamInfo]) -> tuple[list[int], int]:
    """Byte offsets of the tensors in a shared-memory segment's data (after its header), in announced order, each at
    the next multiple of BUCKET_ALIGN, and the data's size: the layout of one bucket that holds everything."""
    (bucket,) = bucket_layout(params, 2**62)
    i, offset = bucket[-1]
    return [off for _, off in bucket], offset + _param_bytes(params[i])


def packed_bytes(params: list[ParamInfo], bucket: list[tuple[int, int]]) -> int:
    """The size of a bucket's flat uint8 buffer; 0 for a bucket of one tensor, which travels as that tensor."""
    if len(bucket) == 1:
        return 0
    i, offset = bucket[-1]
    return offset + _param_bytes(params[i])


def _param_bytes(p: ParamInfo) -> int:
    n = DTYPE_BYTES[p.dtype]
    for d in p.shape:
        n *= d
    return n


def tied_aliases(model: Any) -> dict[str, str]:
    """{alias: canonical name} for every parameter registered under more than one name (tie_word_embeddings:
    {"lm_head.weight": "model.embed_tokens.weight"}). The canonical name is the one `named_parameters()` reports
    (the first registration): a weight update carries each shared tensor once, under that name, and an alias in an
    update is rejected (docs/inference-contract.md, "Tied weights")."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if canonical[id(p)] != n}
