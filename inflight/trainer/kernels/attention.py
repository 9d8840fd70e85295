"""Packed attention without a dense mask: samples of the packed row are gathered into a padded batch and attended
with one causal SDPA call per length bucket.

A block-diagonal T x T mask makes SDPA compute (and mask away) every cross-sample score: T^2 work per row instead
of sum(n_i^2); a Python loop of one SDPA per sample costs a kernel launch per sample and layer (RL batches hold
hundreds of short samples). Here, samples are sorted by length and cut into buckets whose padded area stays within
~25% of their real area; each bucket is right-padded to its longest sample and run through one causal SDPA (right
padding never leaks: a real query only sees keys at or before it, all real). Registered with transformers as
"inflight_packed"; it takes the sample boundaries from `cu_seq_lens_q` (the keyword varlen flash attention uses).
Called without them (a plain forward, e.g. generation with padding) it is exactly transformers' SDPA. Float32 CPU
tensors skip the buckets: row_attention.py runs each sample's causal attention in C, forward and backward.

Inside `packed_call()` the mask function returns None: transformers would otherwise detect the packing from the
position ids and build a dense [T, T] block-diagonal mask that this attention never reads (O(T^2) time and memory:
~8% of a demo step). The bucket indices are computed once per forward, not once per layer.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from inflight.trainer.prefix import length_buckets, shared_sdpa
from inflight.trainer.kernels.row_attention import Rows, row_attention, usable

NAME = "inflight_packed"
_PACKED_CALL = contextvars.ContextVar("inflight_packed_call", default=False)
_INDEX_CACHE: dict[tuple, list | Rows] = {}  # (sample bounds, device) -> per-bucket indices (or the C attention's
# rows), for the layers of one forward


@contextlib.contextmanager
def packed_call() -> Iterator[None]:
    """A forward whose attention gets the sample boundaries (cu_seq_lens_q): no dense mask is built, and the
    bucket indices are shared by all layers."""
    token = _PACKED_CALL.set(True)
    try:
        yield
    finally:
        _PACKED_CALL.reset(token)
        _INDEX_CACHE.clear()


def packed_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask, except inside `packed_call()` where attention does not read a mask."""
    return None if _PACKED_CALL.get() else sdpa_mask(*args, **kwargs)


def _bucket_index(starts: list[int], lengths: list[int], members: list[int],
                  device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Flat indices mapping the bucket's padded [B * L] layout to packed positions (real cells only), and L."""
    width = max(lengths[i] for i in members)
    src: list[int] = []
    dst: list[int] = []
    for row, i in enumerate(members):
        src.extend(range(starts[i], starts[i] + lengths[i]))
        dst.extend(range(row * width, row * width + lengths[i]))
    return torch.tensor(src, device=device), torch.tensor(dst, device=device), width


def _buckets(cu_seq_lens: torch.Tensor, device) -> list:
    """[(members, src, dst, width)] per length bucket; cached while inside `packed_call()`."""
    bounds = cu_seq_lens.tolist()
    key = (tuple(bounds), str(device))
    cached = _INDEX_CACHE.get(key)
    if isinstance(cached, list):
        return cached
    starts, lengths = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    out = [(members, *_bucket_index(starts, lengths, members, device)) for members in length_buckets(lengths)]
    if _PACKED_CALL.get():
        _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = out
    return out


def _rows(cu_seq_lens: torch.Tensor) -> Rows:
    """One row per sample for the C attention; cached like the buckets."""
    bounds = cu_seq_lens.tolist()
    key = ("rows", tuple(bounds))
    cached = _INDEX_CACHE.get(key)
    if isinstance(cached, Rows):
        return cached
    rows = Rows.packed([e - s for s, e in zip(bounds[:-1], bounds[1:])])
    if _PACKED_CALL.get():
        _INDEX_CACHE[key] = rows
    return rows


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    inflight_layout=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if cu_seq_lens_q is None and inflight_layout is None:
        if _PACKED_CALL.get():  # the model dropped the keywords: plain SDPA without a mask would mix samples
            raise RuntimeError(f"attention '{NAME}': this model does not pass the forward's keyword arguments to "
                               "its attention; use trainer.attention=sdpa")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"attention '{NAME}' with cu_seq_lens_q needs one packed row, got {query.shape[0]}")
    if inflight_layout is not None:  # shared prompts (prefix.py)
        return shared_sdpa(query, key, value, inflight_layout, dropout, scaling), None
    assert cu_seq_lens_q is not None  # one of the two, and not the layout
    if dropout == 0.0 and usable(query, key, value):
        return row_attention(query, key, value, _rows(cu_seq_lens_q), scaling), None
    gqa = query.shape[1] != key.shape[1]  # grouped-query attention: SDPA shares each kv head (no repeat copies)
    heads = query.shape[1]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    out = q.new_zeros(q.shape[0], heads, value.shape[3])
    for members, src, dst, width in _buckets(cu_seq_lens_q, q.device):
        padded = []
        for x in (q, k, v):
            buf = x.new_zeros(len(members) * width, x.shape[1], x.shape[2])
            buf = buf.index_copy(0, dst, x.index_select(0, src))
            padded.append(buf.view(len(members), width, x.shape[1], x.shape[2]).transpose(1, 2))
        pq, pk, pv = padded
        o = F.scaled_dot_product_attention(pq, pk, pv, dropout_p=dropout, is_causal=True, scale=scaling,
                                           enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(len(members) * width, heads, -1)
        out = out.index_copy(0, src, o.index_select(0, dst))
    return out[None], None  # [1, T, H, D], transformers' layout after attention


AttentionInterface.register(NAME, packed_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, packed_mask)  # sdpa's mask for plain (non-packed) calls
