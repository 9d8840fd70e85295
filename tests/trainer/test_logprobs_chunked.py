"""token_logprobs works a chunk of rows at a time (no float32 copy of all [T, V] logits): values, entropies and
gradients equal the one-chunk computation and a plain float64 reference, for bf16 and float32 logits."""

import pytest
import torch

from inflight.trainer.accumulate import empty_batch
from inflight.trainer.logprobs import token_logprobs
from inflight.trainer.packing import collate

from .helpers import random_samples

V = 97


def reference(logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, written plainly: log_softmax row by row, 0 on each sample's first token."""
    z = logits.double() / batch.temperature
    lp, ent = torch.zeros(len(z), dtype=torch.float64), torch.zeros(len(z), dtype=torch.float64)
    for t in range(1, len(z)):
        if int(batch.position_ids[t]) == 0:
            continue
        logp = torch.log_softmax(z[t - 1], dim=-1)
        lp[t] = logp[int(batch.input_ids[t])]
        ent[t] = -(logp.exp() * logp).sum()
    return lp, ent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_equals_unchunked_and_float64(dtype):
    batch = collate(random_samples(5, V, seed=3), [1.0] * 5, 5, 100, temperature=0.7)
    T = batch.input_ids.shape[0]
    assert T > 20
    base = (torch.randn(T, V, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    weights = torch.randn(T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for chunk_elems in (10**9, 5 * V, V):  # one chunk; 5 rows per chunk (ragged last); one row per chunk
        logits = base.clone().requires_grad_(True)
        lp, ent = token_logprobs(logits, batch, need_entropy=True, chunk_elems=chunk_elems)
        assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (T,)
        ((lp.double() * weights).sum() + ent.double().sum()).backward()
        results.append((lp.detach(), ent.detach(), logits.grad.clone()))
    ref_lp, ref_ent = reference(base, batch)
    ref_logits = base.double().requires_grad_(True)
    lp64, ent64 = token_logprobs(ref_logits, batch, need_entropy=True, chunk_elems=7 * V)
    ((lp64 * weights).sum() + ent64.sum()).backward()
    torch.testing.assert_close(lp64.detach(), ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent64.detach(), ref_ent, atol=1e-12, rtol=0)
    one, *chunked = results
    for lp, ent, grad in chunked:
        torch.testing.assert_close(lp, one[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(ent, one[1], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, one[2], atol=1e-6, rtol=0)
    for lp, ent, grad in results:
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
        torch.testing.assert_close(grad.double(), ref_logits.grad.to(grad.dtype).double(), atol=2e-2, rtol=0)


def test_no_grad_path_and_single_token():
    batch = collate(random_samples(3, V, seed=4), [0.0] * 3, 3, 50)
    logits = torch.randn(batch.input_ids.shape[0], V)
    with torch.no_grad():
        lp, _ = token_logprobs(logits, batch, chunk_elems=3 * V)
    torch.testing.assert_close(lp.double(), reference(logits, batch)[0], atol=1e-5, rtol=0)
    one = empty_batch(1, 1)  # a one-token batch: nothing predicts its token
    lp, ent = token_logprobs(torch.randn(1, V, requires_grad=True), one, need_entropy=True, chunk_elems=V)
    assert lp.tolist() == [0.0] and ent.tolist() == [0.0]
    assert lp.requires_grad  # still in the graph: FSDP's empty micro-batch backpropagates 0 * lp.sum()
