"""The on-device sampler (engine/model/device_sampling.py) against a plain float64 reference of the contract: the
distribution after temperature, top-k and top-p, each token's logprob under it (temperature-1 for greedy rows),
seeded sampled frequencies, the stop check, and the engine with it against the engine's CPU sampler."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from inflight.engine.core import InferenceEngine
from inflight.engine.model.device_sampling import CONTINUE, LENGTH, STOP, finish_codes, sample_rows
from inflight.engine.model.sampling import SamplingParams, sample
from tests.engine.test_core import ids

torch.set_num_threads(1)


def ref_dist(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """float64 probabilities of one row as the contract defines them (docs/inference-contract.md)."""
    x = logits.double()
    if temperature <= 0:
        return torch.softmax(x, -1)
    p = torch.softmax(x / temperature, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or (rank > 0 and top_p < 1 and mass >= top_p):
            break
        keep[i] = True
        mass += p[i].item()
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


ROWS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.6, 3), (0.0, 0.5, 2), (2.0, 0.95, 40)]


def _rows(V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(ROWS), V, generator=g) * 3
    t = torch.tensor([r[0] for r in ROWS])
    p = torch.tensor([r[1] for r in ROWS])
    k = torch.tensor([r[2] for r in ROWS])
    return logits, t, p, k


def test_distribution_and_logprobs_equal_the_float64_reference():
    logits, t, p, k = _rows()
    V = logits.shape[1]
    u = torch.rand(len(ROWS), generator=torch.Generator().manual_seed(1))
    tokens, logprobs, (vals, idx) = sample_rows(logits, t, p, k, u, filtered=True, num_top=V)
    for i, (temp, top_p, top_k) in enumerate(ROWS):
        want = ref_dist(logits[i], temp, top_p, top_k)
        got = torch.zeros(V, dtype=torch.float64).scatter_(0, idx[i], vals[i].double().exp())  # the whole row
        assert (got - want).abs().max().item() < 1e-6, i
        assert want[tokens[i]] > 0  # never a token outside the top-k/top-p set
        assert abs(logprobs[i].item() - math.log(want[tokens[i]].item())) < 1e-5
        if temp <= 0:
            assert tokens[i].item() == logits[i].argmax().item()


def test_same_as_the_cpu_sampler():
    logits, t, p, k = _rows(V=200, seed=3)
    u = torch.rand(len(ROWS), generator=torch.Generator().manual_seed(4))
    for filtered, num_top in ((True, 4), (False, 0)):
        a = sample_rows(logits, t, p, k, u, filtered, num_top)
        b = sample(logits, t, p, k, u, num_top, filtered)
        assert torch.equal(a[0], b[0])
        assert torch.allclose(a[1], b[1], atol=1e-6)
        if num_top:
            assert torch.equal(a[2][1], b[2][1]) and torch.allclose(a[2][0], b[2][0], atol=1e-6)


@pytest.mark.parametrize("row", [1, 3, 5])
def test_seeded_frequencies_follow_the_distribution(row):
    """20,000 draws of one row: each token's frequency within 5 standard errors of its reference probability."""
    logits, t, p, k = _rows(V=30, seed=5)
    N = 20_000
    u = torch.rand(N, generator=torch.Generator().manual_seed(6))
    rep = lambda x: x[row: row + 1].expand(N, *x.shape[1:])  # noqa: E731
    tokens, _, _ = sample_rows(rep(logits), rep(t), rep(p), rep(k), u, filtered=True)
    freq = torch.bincount(tokens, minlength=30).double() / N
    want = ref_dist(logits[row], *ROWS[row])
    se = (want * (1 - want) / N).sqrt()
    assert ((freq - want).abs() <= 5 * se + 1e-9).all(), (freq - want).abs().max()
    assert (freq[want == 0] == 0).all()


def test_finish_codes():
    tokens = torch.tensor([7, 3, 9, 5, 2])
    stops = torch.tensor([[7, -1], [8, 1], [-1, -1], [5, 9], [-1, -1]])
    n_gen = torch.tensor([0, 4, 9, 0, 1])
    max_tokens = torch.tensor([10, 5, 100, 1, 100])
    seq_len = torch.tensor([5, 5, 10, 5, 63])
    codes = finish_codes(tokens, stops, n_gen, max_tokens, seq_len, max_model_len=64).tolist()
    assert codes == [STOP, LENGTH, CONTINUE, STOP, LENGTH]


def test_engine_with_the_device_sampler_equals_the_cpu_sampler(tiny_model_dir):
    """Same seeded requests (top-p/top-k, top logprobs, stop tokens, n > 1, greedy) on both samplers."""
    reqs = [(ids(5, start=1), SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=20, top_logprobs=4,
                                              stop_token_ids=[10, 11, 12])),
            (ids(9, start=9), SamplingParams(temperature=1.2, top_k=5, seed=2, max_tokens=14, n=3, ignore_eos=True)),
            (ids(4, start=20), SamplingParams(temperature=0.0, max_tokens=12, top_logprobs=2)),
            (ids(6, start=30), SamplingParams(temperature=1.0, seed=3, max_tokens=25, ignore_eos=True))]
    outs = []
    for on_device in (False, True):
        eng = InferenceEngine(str(tiny_model_dir), max_batch=8, max_model_len=40, device_sampling=on_device)
        staging = lambda: [t.data_ptr() for t in (eng.sampler._ints, eng.sampler._floats, eng.sampler._out,  # noqa: E731
                                                  eng.sampler._ints_d, eng.sampler._floats_d)]
        before = staging() if on_device else None
        eng.start()

        async def one(i, prompt, sp):
            return [(e.index, e.token_id, e.logprob, e.finish_reason, e.top_logprobs)
                    async for e in eng.generate(f"r{i}", prompt, sp)]

        async def go():
            return await asyncio.gather(*[one(i, p, sp) for i, (p, sp) in enumerate(reqs)])
        try:
            outs.append(asyncio.run(go()))
        finally:
            eng.stop()
        assert before is None or staging() == before  # the staging buffers are reused, step after step
    for a, b in zip(*outs):
        assert [(e[0], e[1], e[3]) for e in a] == [(e[0], e[1], e[3]) for e in b]
        assert max(abs(x[2] - y[2]) for x, y in zip(a, b)) < 1e-6
        for x, y in zip(a, b):
            assert (x[4] is None) == (y[4] is None)
            if x[4]:
                assert [i for i, _ in x[4]] == [i for i, _ in y[4]]
                assert max(abs(v - w) for (_, v), (_, w) in zip(x[4], y[4])) < 1e-6
    reasons = {e[3] for o in outs[1] for e in o if e[3]}
    assert "length" in reasons
