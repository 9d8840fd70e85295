"""The C row attention (inflight/trainer/kernels/cpu_kernels.c) against attention written plainly in float64: outputs and
the gradients of q, k and v, for packed rows and for rows that share a context (prefix.py's layout)."""

import math
import random

import pytest
import torch

from inflight.trainer.kernels.row_attention import Rows, row_attention, usable

torch.set_num_threads(1)  # the C kernels serve single-threaded torch only
pytestmark = pytest.mark.skipif(not usable(torch.zeros(1)), reason="no C compiler here")


@pytest.fixture(autouse=True)
def _one_thread():
    """Another test may have left torch on more threads; the kernels only run on one."""
    torch.set_num_threads(1)


def reference(q, k, v, rows: list[list[int]], start: list[int], scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D] float64 -> out [T, H, D]: entry i of a row attends to the row's entries 0..i."""
    T, H, D = q.shape
    rep = H // k.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for row, s in zip(rows, start):
        for i in range(s, len(row)):
            t = row[i]
            for h in range(H):
                keys = [row[j] for j in range(i + 1)]
                scores = torch.stack([scale * (q[t, h] * k[j, h // rep]).sum() for j in keys])
                p = torch.softmax(scores, 0)
                out[t, h] = sum(p[n] * v[j, h // rep] for n, j in enumerate(keys))
    return out


def shared_rows(rng: random.Random) -> tuple[int, list[list[int]], list[int]]:
    """Token lists like prefix.py builds: per group a context once, then each member's suffix; a member's row is
    context + own suffix, and only the group's first member computes the context's queries."""
    rows, start, t = [], [], 0
    for _ in range(3):
        ctx = list(range(t, t + rng.randint(1, 5)))
        t += len(ctx)
        for m in range(rng.randint(1, 4)):
            suffix = list(range(t, t + rng.randint(1, 6)))
            t += len(suffix)
            rows.append(ctx + suffix)
            start.append(0 if m == 0 else len(ctx))
    return t, rows, start


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (3, 3, 8), (8, 1, 24)])
@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_matches_float64_forward_and_backward(heads, kv_heads, head_dim, layout):
    rng = random.Random(heads * 10 + kv_heads)
    if layout == "packed":
        lens = [rng.randint(1, 9) for _ in range(6)]
        T, rows, start = sum(lens), [], []
        for n in lens:
            rows.append(list(range(sum(map(len, rows)), sum(map(len, rows)) + n)))
            start.append(0)
        r = Rows.packed(lens)
    else:
        T, rows, start = shared_rows(rng)
        r = Rows.from_lists(rows, start)
    g = torch.Generator().manual_seed(T)
    # transformers' layout: [1, heads, T, D] views of a [1, T, heads, D] projection output (strided tokens)
    q = torch.randn(1, T, heads, head_dim, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(1, T, kv_heads, head_dim, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(1, T, kv_heads, head_dim, generator=g).transpose(1, 2).requires_grad_()
    scale = 1 / math.sqrt(head_dim) * 1.7  # a scaling other than the default
    out = row_attention(q, k, v, r, scale)  # [1, T, H, D]
    dout = torch.randn(out.shape, generator=g)
    (out * dout).sum().backward()

    q64, k64, v64 = (x.detach()[0].transpose(0, 1).double().requires_grad_() for x in (q, k, v))
    ref = reference(q64, k64, v64, rows, start, scale)
    (ref * dout[0].double()).sum().backward()
    torch.testing.assert_close(out[0].double(), ref, atol=2e-6, rtol=1e-5)
    for got, want in ((q, q64), (k, k64), (v, v64)):
        assert got.grad.shape == got.shape and float(want.grad.abs().max()) > 1e-2
        torch.testing.assert_close(got.grad[0].transpose(0, 1).double(), want.grad, atol=1e-5, rtol=1e-4)


def test_a_shared_context_gathers_the_gradient_of_every_row_that_reads_it():
    """Two rows over one context: its keys' gradient is the sum of both rows' contributions."""
    q = torch.randn(1, 2, 5, 8, dtype=torch.float32).requires_grad_()
    k = torch.randn(1, 2, 5, 8).requires_grad_()
    v = torch.randn(1, 2, 5, 8).requires_grad_()
    both = Rows.from_lists([[0, 1, 2], [0, 1, 3, 4]], [0, 2])
    row_attention(q, k, v, both).sum().backward()
    grads = k.grad.clone()
    parts = torch.zeros_like(k)
    for rows, start in (([[0, 1, 2]], [0]), ([[0, 1, 3, 4]], [2])):
        k.grad = None
        row_attention(q, k, v, Rows.from_lists(rows, start)).sum().backward()
        parts += k.grad
    torch.testing.assert_close(grads, parts)
    assert float(grads[0, :, :2].abs().min()) > 0  # the context keys got gradient at all


def test_not_used_for_bf16_or_other_devices():
    assert not usable(torch.zeros(1, dtype=torch.bfloat16))
    assert not usable(torch.zeros(1), torch.zeros(1, dtype=torch.float64))
