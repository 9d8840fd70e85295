"""A parameter as the weight update sends it: whole, detached, in the servers' dtype where it is gathered."""

from __future__ import annotations

import torch


def gathered(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor, detached: a sharded one (FSDP2's DTensor) gathered (collective), each rank's shard cast to
    `dtype` first, so the full tensor exists only in that dtype; a plain one as it is (the sender converts it)."""
    if not hasattr(t, "full_tensor"):
        return t.detach()
    t = t.detach()
    return (t.to(dtype) if dtype is not None and t.dtype != dtype else t).full_tensor()
