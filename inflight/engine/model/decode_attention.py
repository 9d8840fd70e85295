"""Decode attention over the slot KV cache with static shapes (what a CUDA graph can capture), one query token per
sequence.

- `split_attention` (CUDA, Triton): reads only each sequence's own length of its slot. The cache's time axis is cut
  into fixed chunks ("splits"); one program per (sequence, kv head, split) runs an online softmax over the live part
  of its chunk (a split past the sequence's length does nothing) and writes a partial (running max m, sum l,
  unnormalised output acc); `combine` merges the partials. The lengths are read from a tensor inside the kernel, so
  the launch (grid, shapes) is the same every step: graph-capturable. All query heads of a kv head share one
  program (GQA), padded to 16 rows for tl.dot. Keys and values are widened to float32 as they are loaded; for a
  16-bit cache the dots run in tf32, which holds every bf16/fp16 value exactly (q.k is exact; the probabilities
  are rounded to tf32, finer than the bf16 that flash kernels usually round them to).
- `split_reference`: the same math (chunks, blocks, online softmax, `combine`) in plain torch loops, runnable on CPU;
  the tests hold it and the kernel (Triton's interpreter, where Triton is installed) to a float64 softmax.
- `masked_attention`: the static-shape torch path (CPU, or CUDA without Triton): all max_model_len positions of each
  slot, masked past each length. Correct everywhere; it reads the whole cache.
"""

from __future__ import annotations

import math

import torch

try:  # optional: ships with CUDA builds of torch, absent from the CPU build
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 64  # keys per inner iteration
CHUNK = 256  # keys per split (a multiple of BLOCK)


def masked_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [B, H, D]; kc, vc [slots, KV, T, D]; slots, lens [B] int64 -> [B, H, D] in q's dtype (softmax in float32)."""
    B, H, D = q.shape
    KV, T = kc.shape[1], kc.shape[2]
    k = kc.index_select(0, slots)  # [B, KV, T, D]
    v = vc.index_select(0, slots)
    qg = q.view(B, KV, H // KV, D)
    s = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, KV, rep, T]
    dead = torch.arange(T, device=q.device)[None] >= lens[:, None]  # [B, T]
    s = s.masked_fill(dead[:, None, None, :], float("-inf"))
    a = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(a, v).view(B, H, D)


def combine(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Merge per-split partials: m, l [B, H, S], acc [B, H, S, D] (float32) -> [B, H, D]. Split 0 is never empty
    (every length >= 1), so the max over splits is finite and empty splits (m = -inf) weigh exp(-inf) = 0."""
    w = torch.exp(m - m.amax(-1, keepdim=True))
    return (acc * w[..., None]).sum(2) / (l * w).sum(-1)[..., None]


def num_splits(max_len: int) -> int:
    return max(1, math.ceil(max_len / CHUNK))


def split_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The kernel's math step by step in torch (float32 partials, same chunks and blocks): its CPU reference."""
    B, H, D = q.shape
    KV, T = kc.shape[1], kc.shape[2]
    rep, S = H // KV, num_splits(T)
    m = torch.full((B, H, S), float("-inf"))
    l = torch.zeros(B, H, S)
    acc = torch.zeros(B, H, S, D)
    for b in range(B):
        slot, n = int(slots[b]), int(lens[b])
        for g in range(KV):
            qq = q[b, g * rep: (g + 1) * rep].float()  # [rep, D]
            for sp in range(S):
                lo, hi = sp * CHUNK, min(sp * CHUNK + CHUNK, n)
                mi, li, ai = torch.full((rep,), float("-inf")), torch.zeros(rep), torch.zeros(rep, D)
                for start in range(lo, hi, BLOCK):
                    end = min(start + BLOCK, hi)
                    k = kc[slot, g, start:end].float()
                    v = vc[slot, g, start:end].float()
                    s = qq @ k.T * scale
                    m_new = torch.maximum(mi, s.amax(1))
                    alpha, p = torch.exp(mi - m_new), torch.exp(s - m_new[:, None])
                    li = li * alpha + p.sum(1)
                    ai = ai * alpha[:, None] + p @ v
                    mi = m_new
                m[b, g * rep: (g + 1) * rep, sp] = mi
                l[b, g * rep: (g + 1) * rep, sp] = li
                acc[b, g * rep: (g + 1) * rep, sp] = ai
    return combine(m, l, acc).to(q.dtype)


if triton is not None:
    @triton.jit
    def _split_kernel(Q, K, V, Slots, Lens, M, L, Acc, scale,
                      sq_b, sq_h, sk_s, sk_h, sk_t, sv_s, sv_h, sv_t, sm_b, sm_h, sa_b, sa_h, sa_s,
                      REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      CHUNK_N: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        sp = tl.program_id(2)
        slot = tl.load(Slots + b)
        n = tl.load(Lens + b)
        lo = sp * CHUNK_N
        hi = tl.minimum(lo + CHUNK_N, n)
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D)
        live = r < REP
        heads = g * REP + r
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        kb = K + slot * sk_s + g * sk_h
        vb = V + slot * sv_s + g * sv_h
        for start in range(lo, hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            tm = t < hi
            k = tl.load(kb + t[:, None] * sk_t + d[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [REP_PAD, BLOCK_N], float32
            s = tl.where(tm[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(vb + t[:, None] * sv_t + d[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m = m_new
        tl.store(M + b * sm_b + heads * sm_h + sp, m, mask=live)
        tl.store(L + b * sm_b + heads * sm_h + sp, l, mask=live)
        tl.store(Acc + b * sa_b + heads[:, None] * sa_h + sp * sa_s + d[None, :], acc, mask=live[:, None])


def split_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """As masked_attention, reading only each sequence's live keys (Triton; needs `triton`)."""
    if triton is None:
        raise RuntimeError("split_attention needs triton")
    B, H, D = q.shape
    KV, T = kc.shape[1], kc.shape[2]
    rep, S = H // KV, num_splits(T)
    if kc.stride(-1) != 1 or vc.stride(-1) != 1 or D & (D - 1) or D < 16:
        raise ValueError(f"split_attention wants a contiguous power-of-2 head dim >= 16, got {D}")
    q = q.contiguous()
    m = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    # products in float32 either way: a bf16/fp16 value is exact in tf32 (tensor cores), a float32 cache needs ieee
    precision = "ieee" if kc.dtype == torch.float32 else "tf32"
    _split_kernel[(B, KV, S)](
        q, kc, vc, slots, lens, m, l, acc, scale,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), D=D, BLOCK_N=BLOCK, CHUNK_N=CHUNK,
        PRECISION=precision)
    return combine(m, l, acc).to(q.dtype)
