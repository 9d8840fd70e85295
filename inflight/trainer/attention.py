"""Packed attention without a dense mask: causal SDPA over each sample's own slice of the packed row.

A block-diagonal T x T mask makes SDPA compute (and mask away) every cross-sample score: T^2 work per row
instead of sum(n_i^2). This attention function, registered with transformers as "inflight_packed", takes the
sample boundaries (`cu_seq_lens_q`, the same keyword varlen flash attention uses) and runs causal SDPA per sample,
so packing costs no more attention than unpacked samples. Called without `cu_seq_lens_q` (a plain forward of
the same model, e.g. generation with padding) it is exactly transformers' SDPA with the usual mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "inflight_packed"


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"attention '{NAME}' with cu_seq_lens_q needs one packed row, got {query.shape[0]}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: share each kv head across its query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    bounds = cu_seq_lens_q.tolist()
    parts = [  # a list + cat: slice assignment into one buffer would copy the whole gradient per sample
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout, is_causal=True, scale=scaling
        )
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the mask for plain (non-packed) calls
