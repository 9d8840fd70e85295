"""Packed attention without a dense mask: samples of the packed row are gathered into a padded batch and attended
with one causal SDPA call per length bucket.

A block-diagonal T x T mask makes SDPA compute (and mask away) every cross-sample score: T^2 work per row instead
of sum(n_i^2); a Python loop of one SDPA per sample costs a kernel launch per sample and layer (RL batches hold
hundreds of short samples). Here, samples are sorted by length and cut into buckets whose padded area stays within
~25% of their real area; each bucket is right-padded to its longest sample and run through one causal SDPA (right
padding never leaks: a real query only sees keys at or before it, all real). Registered with transformers as
"inflight_packed"; it takes the sample boundaries from `cu_seq_lens_q` (the keyword varlen flash attention uses).
Called without them (a plain forward, e.g. generation with padding) it is exactly transformers' SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "inflight_packed"
_PAD_SLACK = 1.25  # a bucket's padded area may exceed its real area by this factor


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Sample indices grouped so that len(bucket) * max_len^2 <= slack * sum(len^2) (sorted by length)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    buckets: list[list[int]] = []
    area = 0
    for i in order:
        n = lengths[i]
        if buckets and (len(buckets[-1]) + 1) * n * n <= _PAD_SLACK * (area + n * n):
            buckets[-1].append(i)
            area += n * n
        else:
            buckets.append([i])
            area = n * n
    return buckets


def _bucket_index(starts: list[int], lengths: list[int], members: list[int], device) -> tuple[torch.Tensor, ...]:
    """Flat indices mapping the bucket's padded [B * L] layout to packed positions (real cells only)."""
    width = max(lengths[i] for i in members)
    src, dst = [], []
    for row, i in enumerate(members):
        src.extend(range(starts[i], starts[i] + lengths[i]))
        dst.extend(range(row * width, row * width + lengths[i]))
    return torch.tensor(src, device=device), torch.tensor(dst, device=device), width


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
    starts, lengths = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    heads = query.shape[1]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    out = q.new_zeros(q.shape[0], heads, value.shape[3])
    for members in length_buckets(lengths):
        src, dst, width = _bucket_index(starts, lengths, members, q.device)
        padded = []
        for x in (q, k, v):
            buf = x.new_zeros(len(members) * width, heads, x.shape[2])
            buf = buf.index_copy(0, dst, x.index_select(0, src))
            padded.append(buf.view(len(members), width, heads, x.shape[2]).transpose(1, 2))
        o = F.scaled_dot_product_attention(*padded, dropout_p=dropout, is_causal=True, scale=scaling)
        o = o.transpose(1, 2).reshape(len(members) * width, heads, -1)
        out = out.index_copy(0, src, o.index_select(0, dst))
    return out[None], None  # [1, T, H, D], transformers' layout after attention


AttentionInterface.register(NAME, packed_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the mask for plain (non-packed) calls
