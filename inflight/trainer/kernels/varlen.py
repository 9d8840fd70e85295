"""Packed attention as one variable-length call per layer ("inflight_varlen"): torch's own varlen flash kernel
(`torch.nn.attention.varlen.varlen_attn`, CUDA) over all samples of the packed row at once.

Why: attention.py's packed path runs one SDPA per length bucket per layer (RL micro-batches of mixed lengths make
several buckets, each a gather into a padded buffer, a kernel and a scatter back). The varlen kernel takes the
sample boundaries (cu_seq_lens) and runs every sample's causal attention in one launch, no padding, no copies
beyond the [T, heads, D] layout it wants.

Shared prompts (prefix.py): each sample's row is [its context; its own suffix] over the compact tokens. Its keys
and queries are gathered row after row (a shared context is read into every row that needs it, as the bucket path
does), the rows are the varlen call's sequences, and each compact token's output is written back from one row only.

The kernel runs in the compute dtype (autocast's under bf16-mixed), whatever dtype RoPE hands q / k over in, and
is called with the keywords the installed torch's `varlen_attn` has (`call_varlen`). Where it does not run (CPU,
float32 on CUDA, or a torch without it) the call falls back to attention.py's path: the results are the same
attention; `CALLS` counts the layer calls by path. `CPU_KERNEL` (None) lets the tests run this module's layout code on CPU with a
reference kernel of the same signature.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from inflight.trainer.kernels.attention import packed_mask, packed_sdpa

NAME = "inflight_varlen"
CPU_KERNEL = None  # tests: a kernel(q, k, v, cu, max_len, scale) -> out on CPU; None: attention.py's path
CALLS: collections.Counter[str] = collections.Counter()  # layer calls by path, "kernel" or "fallback" (the GPU
# bench reports which one its steps ran)


def available(device: torch.device | str = "cuda") -> bool:
    """The varlen kernel runs on this device (CUDA with torch >= 2.9's varlen_attn), or the tests gave one."""
    if torch.device(device).type != "cuda":
        return CPU_KERNEL is not None
    try:
        from torch.nn.attention.varlen import varlen_attn  # lazy: optional, torch >= 2.9 builds only  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


HALF = (torch.float16, torch.bfloat16)


def compute_dtype(query: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's where it is on (SDPA would cast to it too), else the inputs'.
    Not the query's own: with float32 master weights under autocast, RoPE multiplies the bf16 q / k by float32
    cos / sin and hands them over in float32, while v (no RoPE) is bf16."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(query.dtype, value.dtype)


def _kernel(device: torch.device, dtype: torch.dtype):
    if device.type == "cuda":
        return _cuda_varlen if dtype in HALF and available("cuda") else None  # flash: half precision only
    return CPU_KERNEL if device.type == "cpu" else None


@functools.lru_cache(maxsize=8)
def _keywords(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def call_varlen(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """`fn` (torch's varlen_attn) over every sequence of the row, causal, with the keywords this torch has:
    `enable_gqa` is newer than torch 2.11 (without it the kv heads are repeated here), older builds take
    `is_causal` instead of `window_size`, and without `scale` the query is scaled here (the kernel's default
    1 / sqrt(D) undone)."""
    kw = _keywords(fn)
    extra: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in kw:
            extra["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "window_size" in kw:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    if "scale" in kw:
        extra["scale"] = scale
    else:
        q = q * (scale * q.shape[-1] ** 0.5)
    return fn(q, k, v, cu, cu, max_len, max_len, **extra)


def _cuda_varlen(q, k, v, cu, max_len, scale):
    from torch.nn.attention.varlen import varlen_attn  # lazy: optional, torch >= 2.9 builds only

    return call_varlen(varlen_attn, q, k, v, cu, max_len, scale)


def reference_varlen(q, k, v, cu, max_len, scale):
    """The kernel's semantics written plainly (tests): per sequence [cu[i], cu[i+1]), causal attention of its
    queries over its keys; q [T, H, D], k / v [T, KV, D] -> [T, H, D]."""
    bounds = cu.tolist()
    out = []
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros(q.shape)


def varlen_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                cu_seq_lens_q=None, inflight_layout=None, **kwargs):
    """transformers attention function: query [1, H, T, D], key / value [1, KV, T, D] -> ([1, T, H, D], None)."""
    dtype = compute_dtype(query, value)
    kernel = _kernel(query.device, dtype) if dropout == 0.0 else None
    if kernel is None or (cu_seq_lens_q is None and inflight_layout is None) or query.shape[0] != 1:
        CALLS["fallback"] += 1
        return packed_sdpa(module, query, key, value, attention_mask, dropout, scaling,
                           cu_seq_lens_q=cu_seq_lens_q, inflight_layout=inflight_layout, **kwargs)
    CALLS["kernel"] += 1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (x[0].transpose(0, 1).to(dtype).contiguous() for x in (query, key, value))  # [T, heads, D]
    if inflight_layout is None:
        cu = cu_seq_lens_q.to(torch.int32)
        max_len = kwargs.get("max_length_q")
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max())
        return kernel(q, k, v, cu, int(max_len), scale)[None], None
    src, cu, max_len, out_src, out_pos = inflight_layout.concat_rows
    o = kernel(q.index_select(0, src), k.index_select(0, src), v.index_select(0, src), cu, max_len, scale)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2]).index_copy(0, out_src, o.index_select(0, out_pos))
    return out[None], None


AttentionInterface.register(NAME, varlen_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, packed_mask)
