"""LoRA adapter updates as merged weights: W = W0 + scaling * B @ A for each adapted base weight.

Why merged: decoding then runs at full-model speed (no extra low-rank matmuls per token), and the engine's pause
is the same in-place swap of finished tensors as a full update: the merge itself runs off the engine thread, into
new buffers, while generation goes on with the old weights.

`AdapterState` keeps W0, the base weights, only for the weights an adapter touched since the last full update (a
copy taken the first time each is adapted: the model's current value then is W0), and which bases the served
adapter covers. An adapter update replaces the previous adapter whole: an adapted base that the new adapter does
not list is served as W0 again. A full update replaces W0 and drops the adapter (adapted bases it does not list go
back to W0 too), so W0 copies are freed.

Only torch is imported: the vLLM worker extension uses this module in vLLM's environment.
"""

from __future__ import annotations

from typing import Mapping

import torch

LORA_A, LORA_B = ".lora_A", ".lora_B"


def merge(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W0 + scaling * B @ A as a new tensor of W0's dtype and device. Half-precision bases are merged in float32
    (B @ A summed over the rank in bf16 would lose the low bits of a small update) and rounded once."""
    a, b = a.to(w0.device), b.to(w0.device)
    if w0.dtype in (torch.float32, torch.float64):
        return torch.addmm(w0, b.to(w0.dtype), a.to(w0.dtype), alpha=scaling)
    return torch.addmm(w0.float(), b.float(), a.float(), alpha=scaling).to(w0.dtype)


def bases_of(names) -> list[str]:
    """The base weights of an adapter's tensor names (`<base>.lora_A` / `<base>.lora_B`), in first-seen order."""
    out: dict[str, None] = {}
    for n in names:
        out[n[: -len(LORA_A)] if n.endswith((LORA_A, LORA_B)) else n] = None
    return list(out)


class AdapterState:
    """W0 of the adapted weights and the bases of the adapter being served. Not thread-safe: its owner (the
    weight receiver) runs one update at a time."""

    def __init__(self) -> None:
        self.w0: dict[str, torch.Tensor] = {}  # base name -> W0 (a private copy)
        self.active: tuple[str, ...] = ()  # bases of the adapter being served (W != W0)
        self.rank = 0
        self.scaling = 0.0

    def merged(self, params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
               scaling: float) -> dict[str, torch.Tensor]:
        """The tensors to load for the adapter `tensors` ({<base>.lora_A / .lora_B: tensor}): every listed base
        merged from W0, every base of the served adapter that it does not list back to W0. `params`: the model's
        current weights by name (read only to copy W0 the first time a base is adapted). Runs off the engine
        thread; changes nothing the engine reads."""
        bases = bases_of(tensors)
        for base in bases:
            if base not in self.w0:  # never adapted since the last full update: its current value is W0
                self.w0[base] = params[base].detach().clone()
        out = {base: merge(self.w0[base], tensors[base + LORA_A], tensors[base + LORA_B], scaling) for base in bases}
        for base in self.active:
            if base not in out:
                out[base] = self.w0[base]  # copied in place by the load: W0 itself stays unchanged
        return out

    def with_reverts(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full update's tensors plus W0 for every adapted base it does not list (the adapter is dropped)."""
        missing = {base: self.w0[base] for base in self.active if base not in tensors}
        return {**tensors, **missing} if missing else tensors

    def served(self, bases, rank: int, scaling: float) -> None:
        """After an adapter update was loaded: these bases are served merged."""
        self.active, self.rank, self.scaling = tuple(bases), rank, scaling

    def dropped(self) -> None:
        """After a full update was loaded: W0 is whatever the model now holds."""
        self.w0, self.active, self.rank, self.scaling = {}, (), 0, 0.0

    def describe(self) -> dict:
        return {"rank": self.rank, "scaling": self.scaling, "bases": len(self.active),
                "base_copy_bytes": sum(t.numel() * t.element_size() for t in self.w0.values())}
