"""Packed causal attention in C (cpu_kernels.c), forward and backward, for float32 on CPU.

Why: at RL sample lengths (tens of tokens) the per-bucket SDPA of attention.py / prefix.py spent its time around
the arithmetic. On the CPU demo's step (128 samples, tiny model, torch.profiler) SDPA's flash kernels and their
backward took ~18% of the step, the gathers into padded buckets, their zero fills and the scatters back another
~6%, for ~0.3 GFLOP of attention. Here one C call per layer reads q/k/v where the projection left them, through
each sample's index row, with no padding and no copies; the backward recomputes the probabilities from the saved
log-sum-exp. bench/trainer.py --rl-step times the step against an earlier commit (docs/benchmarks.md).

A `Rows` describes the micro-batch (see cpu_kernels.c): the packed layout has one row per sample over its own
tokens; the shared-prompt layout (prefix.py) has each sample's row read its group's prompt and its own completion,
with the prompt's queries computed by the group's first row only. `usable()` says whether the kernel applies
(float32 CPU tensors, torch on one thread, the library built); otherwise the callers keep their SDPA path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inflight.trainer.kernels.cpu_kernels import kernels
from inflight.trainer.kernels.cpu_kernels import usable


@dataclass
class Rows:
    off: torch.Tensor  # [R + 1] int64: row r is idx[off[r]:off[r + 1]]
    idx: torch.Tensor  # token indices, each row in position order
    start: torch.Tensor  # [R] int64: the row computes the queries of its entries from start[r] on
    max_len: int

    @classmethod
    def from_lists(cls, rows: list[list[int]], start: list[int]) -> "Rows":
        off = [0]
        for r in rows:
            off.append(off[-1] + len(r))
        return cls(torch.tensor(off), torch.tensor([t for r in rows for t in r], dtype=torch.long),
                   torch.tensor(start, dtype=torch.long), max(map(len, rows), default=0))

    @classmethod
    def packed(cls, seq_lens: list[int]) -> "Rows":
        """One row per sample of a packed row, over its own consecutive tokens."""
        off = torch.tensor([0, *seq_lens]).cumsum(0)
        return cls(off, torch.arange(int(off[-1])), torch.zeros(len(seq_lens), dtype=torch.long),
                   max(seq_lens, default=0))


def _heads(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """[1, heads, T, D] (transformers' layout) -> a [T, heads, D] view with a contiguous last dim, and its token
    and head strides."""
    x = x[0].transpose(0, 1)
    if x.stride(2) != 1:
        x = x.contiguous()
    return x, x.stride(0), x.stride(1)


def _args(q, k, v, rows: Rows, scale: float) -> list:
    (qt, sqt, sqh), (kt, skt, skh), (vt, svt, svh) = q, k, v
    return [qt.data_ptr(), sqt, sqh, kt.data_ptr(), skt, skh, vt.data_ptr(), svt, svh, rows.off.data_ptr(),
            rows.idx.data_ptr(), rows.start.data_ptr(), rows.start.shape[0], qt.shape[1], kt.shape[1], qt.shape[2],
            scale]


class _RowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, rows: Rows, scale: float):
        q, k, v = _heads(query), _heads(key), _heads(value)
        T, H, D = q[0].shape
        if H % k[0].shape[1]:
            raise ValueError(f"{H} query heads are not a multiple of {k[0].shape[1]} kv heads")
        out = torch.zeros(T, H, D)  # every token is some row's query; zeros keep a malformed Rows harmless
        lse = torch.zeros(T, H)
        scratch = torch.empty(max(rows.max_len, 1))
        kernels().row_attention_forward(*_args(q, k, v, rows, scale), out.data_ptr(), lse.data_ptr(),
                                     scratch.data_ptr())
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.rows, ctx.scale = rows, scale
        return out[None]

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out, lse = ctx.saved_tensors
        q, k, v = _heads(query), _heads(key), _heads(value)
        dout = dout[0].contiguous()
        dq = torch.zeros(q[0].shape)
        dk, dv = torch.zeros(k[0].shape), torch.zeros(v[0].shape)
        kernels().row_attention_backward(*_args(q, k, v, ctx.rows, ctx.scale), out.data_ptr(), dout.data_ptr(),
                                      lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
        # gradients in the inputs' [1, heads, T, D] shape (as views of the [T, heads, D] buffers)
        return dq.transpose(0, 1)[None], dk.transpose(0, 1)[None], dv.transpose(0, 1)[None], None, None


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: Rows,
                  scale: float | None = None) -> torch.Tensor:
    """query [1, H, T, D], key/value [1, KV, T, D] -> [1, T, H, D]: each row's entries attend causally to the
    row's earlier entries; differentiable in query, key and value."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return _RowAttention.apply(query, key, value, rows, scale)
