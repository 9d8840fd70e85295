"""An update packed once and sent as often as needed: for a trainer whose tensors are fresh copies made for the push
(FSDP2 gathers each one, on every rank, in a collective that must run exactly once per push).

Each tensor is converted to the servers' dtype and packed into its bucket as it arrives (the buckets of
`contracts.bucket_layout`, built as they fill: the rule only looks at the tensors before), and dropped once copied.
The result holds the update exactly once, in the wire dtype: what the broadcasts send, in order. Building it takes
at most one open bucket's tensors and its buffer beyond that, so rank 0 never holds the model twice; a retry
(a restarted server) resends it without gathering again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from inflight.transport.layout import BUCKET_ALIGN, bucket_layout



from inflight.transport.schemas import ParamInfo


@dataclass
class PreparedUpdate:
    params: list[dict]  # the announcement: {name, shape, dtype} in order
    payload: list[torch.Tensor]  # one per bucket: a lone tensor as it is, several packed into one uint8 buffer
    bucket_bytes: int
    nbytes: int  # the tensors' bytes (packing padding not counted)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def prepare_update(named: Iterable[tuple[str, torch.Tensor]], convert: Callable[[torch.Tensor], torch.Tensor],
                   bucket_bytes: int) -> PreparedUpdate:
    """Consume `named` one tensor at a time (each converted by `convert`) into a PreparedUpdate. Every tensor must
    come once: a tied alias would be sent twice (a trainer's named_weights yields each tensor once)."""
    params: list[dict] = []
    payload: list[torch.Tensor] = []
    pending: list[tuple[int, torch.Tensor]] = []  # (byte offset, tensor) of the open bucket
    shape: list[list[int]] = []  # the byte offsets of each closed bucket's tensors
    nbytes, end = 0, bucket_bytes

    def close_bucket() -> None:
        if pending:
            shape.append([off for off, _ in pending])
        if len(pending) == 1:
            payload.append(pending[0][1])
        elif pending:
            last_off, last = pending[-1]
            buf = torch.empty(last_off + last.numel() * last.element_size(), dtype=torch.uint8, device=last.device)
            for off, t in pending:
                buf[off: off + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
            payload.append(buf)
        pending.clear()

    for name, tensor in named:
        t = convert(tensor)
        del tensor  # a converted copy replaces the gathered one
        size = t.numel() * t.element_size()
        start = -(-end // BUCKET_ALIGN) * BUCKET_ALIGN
        if not params or start + size > bucket_bytes:
            close_bucket()
            start = 0
        pending.append((start, t))
        end, nbytes = start + size, nbytes + size
        params.append({"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype)})
        del t
    close_bucket()
    expected = [[off for _, off in b] for b in bucket_layout([ParamInfo(**p) for p in params], bucket_bytes)]
    if expected != shape:  # the servers derive their receive buffers from bucket_layout
        raise AssertionError("prepared buckets differ from contracts.bucket_layout")
    return PreparedUpdate(params, payload, bucket_bytes, nbytes)
