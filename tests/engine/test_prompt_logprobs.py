"""Prompt logprobs in the built-in engine (prompt_scores.py, SamplingParams.prompt_logprobs): every prompt token's
logprob, rank and top-k equal a float64 HF forward of the weights the engine reports, through chunked prefill, the
generic HF runner, max_tokens=0, a retained prefix that must not be reused, and weight updates mid-prefill."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.engine.core import SamplingParams
from inflight.engine.model import prompt_scores
from tests.engine.test_core import TOL, collect, fresh_engine, gpt2_dir, ids, perturbed, ref_with  # noqa: F401

torch.set_num_threads(1)


def ref_prompt(model, prompt: list[int]) -> torch.Tensor:
    """float64 log-softmax of every prompt position but the last: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].double(), dim=-1)


def assert_scores(model, prompt, scores, k):
    assert scores is not None and scores.complete
    assert scores.logprobs[0] is None and scores.ranks[0] is None and scores.versions[0] is None
    ref = ref_prompt(model, prompt)
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    got = torch.tensor(scores.logprobs[1:], dtype=torch.float64)
    assert (got - want).abs().max().item() < TOL, (got - want).abs().max().item()
    ranks = (ref > want[:, None] + 1e-6).sum(-1) + 1  # a rank is exact unless two logprobs are within float32 noise
    assert all(abs(r - int(w)) <= 1 for r, w in zip(scores.ranks[1:], ranks)), (scores.ranks[1:], ranks.tolist())
    assert sum(r == int(w) for r, w in zip(scores.ranks[1:], ranks)) >= 0.9 * len(ranks)
    for pos, row in enumerate(scores.tops[1:]):
        assert len(row) == k
        vals, top_ids = ref[pos].topk(k)
        assert [t for t, _ in row] == top_ids.tolist() or torch.allclose(
            torch.tensor([v for _, v in row], dtype=torch.float64), vals, atol=TOL)
        assert max((abs(v - ref[pos, t].item()) for t, v in row), default=0.0) < TOL


def run(eng, rid, prompt, params):
    evs = asyncio.run(collect(eng, rid, prompt, params))
    scored = [e.prompt for e in evs if e.prompt is not None]
    assert len(scored) == 1  # on one event only (choice 0's first)
    return evs, scored[0]


@pytest.fixture(scope="module")
def ref64(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).double().eval()


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_prompt_scores_equal_float64_forward_through_chunked_prefill(tiny_model_dir, ref64, max_tokens):
    eng = fresh_engine(tiny_model_dir, max_tokens_per_step=16, max_model_len=200)
    try:
        prompt = ids(70, start=9)  # 5 prefill chunks of 16 tokens
        evs, scores = run(eng, "a", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                           prompt_logprobs=3, n=2))
    finally:
        eng.stop()
    assert_scores(ref64, prompt, scores, 3)
    assert scores.versions[1:] == [0] * (len(prompt) - 1)
    gen = [e for e in evs if e.token_id >= 0]
    assert len(gen) == 2 * max_tokens  # max_tokens=0: nothing generated, each choice ends with "length"
    assert sorted(e.finish_reason for e in evs if e.finish_reason) == ["length", "length"]


def test_generic_hf_runner_scores_the_prompt(gpt2_dir):
    eng = fresh_engine(gpt2_dir, max_tokens_per_step=8)
    try:
        prompt = ids(20, start=2)
        _, scores = run(eng, "g", prompt, SamplingParams(max_tokens=2, prompt_logprobs=2))
    finally:
        eng.stop()
    ref = AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=torch.float32).double().eval()
    assert_scores(ref, prompt, scores, 2)


def test_a_retained_prefix_is_not_reused_for_a_scored_prompt(tiny_model_dir, ref64):
    eng = fresh_engine(tiny_model_dir, max_model_len=200, prefix_reuse=True)
    try:
        first = ids(40, start=5)
        evs = asyncio.run(collect(eng, "t1", first, SamplingParams(max_tokens=4, ignore_eos=True)))
        prompt = first + [e.token_id for e in evs] + ids(10, start=50)  # a next turn: the prefix is retained
        before = eng.stats()
        _, scores = run(eng, "t2", prompt, SamplingParams(max_tokens=3, prompt_logprobs=0))
        mid = eng.stats()
        # the same prompt without scores does reuse the retained KV (so the first request really skipped it)
        asyncio.run(collect(eng, "t1b", first, SamplingParams(max_tokens=4, ignore_eos=True)))
        asyncio.run(collect(eng, "t3", first + ids(10, start=50), SamplingParams(max_tokens=1)))
        after = eng.stats()
    finally:
        eng.stop()
    assert mid["prefix_reused_tokens_total"] == before["prefix_reused_tokens_total"]
    assert mid["prefill_tokens_total"] - before["prefill_tokens_total"] >= len(prompt)
    assert after["prefix_reused_tokens_total"] > mid["prefix_reused_tokens_total"]
    assert_scores(ref64, prompt, scores, 0)


@pytest.mark.parametrize("mode", ["interrupt", "keep"])
def test_weight_update_during_a_scored_prefill(tiny_model_dir, ref64, mode):
    """After an update, a scored prompt matches the new weights and says so; an update landing half-way through a
    chunked prefill: `interrupt` re-scores the whole prompt with the new weights, `keep` reports each chunk's
    version (older first)."""
    eng = fresh_engine(tiny_model_dir, max_tokens_per_step=8, max_model_len=200)
    w1, w2 = perturbed(eng, seed=41), perturbed(eng, seed=42)
    prompt = ids(100, start=7)
    asyncio.run(eng.run_paused(lambda: eng.load_weights(w1, 1, mode=mode)))
    _, after_update = run(eng, "u", prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    mid, queued = threading.Event(), threading.Event()
    step = eng._step

    def step_then_wait_mid_prefill():  # once, the engine thread waits until the update is queued
        step()
        if not mid.is_set() and eng._running and 30 <= eng._running[0].num_cached < 90:
            mid.set()
            queued.wait(10)

    eng._step = step_then_wait_mid_prefill

    async def main():
        req = asyncio.create_task(collect(eng, "m", prompt, SamplingParams(max_tokens=2, prompt_logprobs=1)))
        await asyncio.get_running_loop().run_in_executor(None, mid.wait, 10)
        upd = asyncio.create_task(eng.run_paused(lambda: eng.load_weights(w2, 2, mode=mode)))
        await asyncio.sleep(0)
        queued.set()
        await upd
        return await req

    try:
        evs = asyncio.run(main())
    finally:
        eng.stop()
    assert_scores(ref_with(tiny_model_dir, w1), prompt, after_update, 1)
    assert set(after_update.versions[1:]) == {1}
    scores = next(e.prompt for e in evs if e.prompt is not None)
    v = scores.versions[1:]
    if mode == "interrupt":
        assert set(v) == {2}
        assert_scores(ref_with(tiny_model_dir, w2), prompt, scores, 1)
    else:
        assert v == sorted(v) and v[0] == 1 and v[-1] == 2  # chunks before the update, then after it
        n1 = v.count(1)
        ref = ref_prompt(ref_with(tiny_model_dir, w1), prompt)  # positions scored before the update: the old weights
        want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:n1, 0]
        assert (torch.tensor(scores.logprobs[1 : n1 + 1], dtype=torch.float64) - want).abs().max() < TOL


def test_scored_prefill_chunks_are_capped(tiny_model_dir, ref64, monkeypatch):
    """A scored prompt is prefilled at most MAX_ROWS positions per step (its logits are [rows, vocab] float32)."""
    monkeypatch.setattr(prompt_scores, "MAX_ROWS", 10)
    eng = fresh_engine(tiny_model_dir, max_tokens_per_step=256, max_model_len=200)
    try:
        prompt = ids(45, start=3)
        steps = eng.stats()["steps"]
        _, scores = run(eng, "c", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
        assert eng.stats()["steps"] - steps == 5  # 10 + 10 + 10 + 10 + 5 positions
    finally:
        eng.stop()
    assert_scores(ref64, prompt, scores, 1)
