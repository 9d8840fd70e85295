"""Generic fallback: any AutoModelForCausalLM through its own forward, one HF cache per sequence.

Correct for every architecture transformers supports (sliding windows, hybrid caches, ...), but it runs one
forward per sequence per step, so it is slower than the fast llama path at large batch. Prefix reuse keeps a
finished sequence's cache under its slot; as a cache cannot be cut back in general (sliding-window layers), a
request reuses one only whole (prefix_cache.py, `exact_only`).
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from inflight.engine.scheduler.step import StepPlan


class HFRunner:
    def __init__(self, model: PreTrainedModel, max_batch: int, max_model_len: int):
        self.model = model
        self.device = next(model.parameters()).device
        self.kernels = None  # the C kernels (sampling included) are the llama path's
        self.caches: dict[int, DynamicCache] = {}
        # transformers renamed `past_key_values` to `cache` during 5.x
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.caches[dst] = copy.deepcopy(self.caches[src])  # the source holds exactly `length` tokens here

    def reset_slot(self, slot: int) -> None:
        self.caches.pop(slot, None)

    def after_weight_update(self) -> None:
        pass

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        want = set(plan.out_rows.tolist())
        slots, positions = plan.token_slots.tolist(), plan.positions.tolist()
        rows: dict[int, torch.Tensor] = {}
        off = 0
        while off < len(slots):  # one chunk = a run of tokens sharing a slot
            end = off + 1
            while end < len(slots) and slots[end] == slots[off] and positions[end] == positions[end - 1] + 1:
                end += 1
            slot, start = slots[off], positions[off]
            if start == 0 or slot not in self.caches:
                self.caches[slot] = DynamicCache(config=self.model.config)
            ids = plan.tokens[off:end][None]
            pos = plan.positions[off:end][None]
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self.cache_kw: self.caches[slot]})
            for r in range(off, end):  # the chunk's last row to sample; earlier ones when a prompt is scored
                if r in want:
                    rows[r] = out.logits[0, r - off].float()
            off = end
        return torch.stack([rows[r] for r in plan.out_rows.tolist()]) if rows else torch.empty(0)
