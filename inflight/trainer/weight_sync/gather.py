"""A parameter as the weight update sends it: whole, detached, in the servers' dtype where it is gathered."""

from __future__ import annotations

from typing import Protocol, cast

import torch


class _Sharded(Protocol):
    """What gathered() uses of a DTensor (torch.distributed.tensor costs seconds to import; FSDP2 has it loaded)."""

    def full_tensor(self) -> torch.Tensor: ...


def gathered(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor, detached: a sharded one (FSDP2's DTensor) gathered (collective), each rank's shard cast to
    `dtype` first, so the full tensor exists only in that dtype; a plain one as it is (the sender converts it)."""
    if not hasattr(t, "full_tensor"):
        return t.detach()
    t = t.detach()
    return cast(_Sharded, t.to(dtype) if dtype is not None and t.dtype != dtype else t).full_tensor()
