"""Prefix reuse in the built-in engine (prefix_cache.py): a request that continues a finished sequence (a multi-turn
episode's next turn) prefills only what is new, and its logprobs are those of a full prefill (the engine without
reuse, and a float64 HF forward of the whole sequence); an `interrupt` update drops retained KV; retained slots
never make a request wait."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.engine.core import SamplingParams
from inflight.engine.scheduler.prefix_cache import Slots
from tests.engine.test_core import TOL, choice, collect, fresh_engine, gpt2_dir, ids, perturbed, ref_logprobs, ref_with  # noqa: F401

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def ref64(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).double().eval()


def run(eng, rid, prompt, params=GREEDY, **gate):
    """(events, prefill tokens, reused tokens) of one request run alone."""
    st = eng.stats()
    evs = asyncio.run(_gated(eng, rid, prompt, params, gate))
    after = eng.stats()
    return (evs, after["prefill_tokens_total"] - st["prefill_tokens_total"],
            after["prefix_reused_tokens_total"] - st["prefix_reused_tokens_total"])


async def _gated(eng, rid, prompt, params, gate):
    return [ev async for ev in eng.generate(rid, prompt, params, **gate)]


def toks(evs):
    return [e.token_id for e in evs if e.token_id >= 0]


def lps(evs):
    return torch.tensor([e.logprob for e in evs if e.token_id >= 0], dtype=torch.float64)


def assert_float64(model, prompt, evs):
    err = (lps(evs) - ref_logprobs(model, prompt, toks(evs))).abs().max().item()
    assert err < TOL, err


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    on, off = (fresh_engine(tiny_model_dir, max_batch=4, max_model_len=200, max_tokens_per_step=32, prefix_reuse=r)
               for r in (True, False))
    yield on, off
    on.stop()
    off.stop()


def test_episode_turns_prefill_only_the_delta_and_match_a_full_prefill(engines, ref64):
    """Three turns of an episode (prompt, reply, environment delta, reply, ...): with reuse each later turn prefills
    only the previous reply's last token (never run through the model) and the delta; the logprobs equal the engine
    without reuse within 1e-5 and the float64 forward of the whole episode."""
    on, off = engines
    episode = ids(40, start=9)
    for turn in range(3):
        ev_on, pre_on, reu_on = run(on, f"on{turn}", episode)
        ev_off, pre_off, reu_off = run(off, f"off{turn}", episode)
        assert toks(ev_on) == toks(ev_off) and len(toks(ev_on)) == 16
        assert (lps(ev_on) - lps(ev_off)).abs().max().item() < 1e-5
        assert_float64(ref64, episode, ev_on)
        assert (pre_off, reu_off) == (len(episode), 0)
        if turn == 0:
            assert (pre_on, reu_on) == (len(episode), 0)
        else:  # reused: the previous turn's prompt and reply but its last token; prefilled: that token + the delta
            assert (pre_on, reu_on) == (1 + 11, len(episode) - 12)
        assert on.stats()["retained"] >= 1
        episode = episode + toks(ev_on) + ids(11, start=50 + 7 * turn)  # the environment's turn


def test_a_shorter_common_prefix_and_a_group_of_samples(engines, ref64):
    """The client kept only part of the reply (a stop string): the KV is reused up to where the prompts differ and
    the rest of the retained slot is overwritten. A request with n=3 continues one retained sequence once (choice 0
    takes the slot over, the others copy its KV after the delta) and every choice stays exact."""
    on, _ = engines
    first = ids(33, start=21)
    ev, _, _ = run(on, "cut0", first)
    cut = first + toks(ev)[:5] + ids(7, start=3)
    ev2, pre, reused = run(on, "cut1", cut)
    assert (pre, reused) == (7, len(first) + 5)
    assert_float64(ref64, cut, ev2)
    group = cut + toks(ev2) + ids(9, start=60)
    sp = SamplingParams(max_tokens=12, ignore_eos=True, n=3, seed=5)
    ev3, pre, reused = run(on, "group", group, sp)
    assert (pre, reused) == (1 + 9, len(cut) + 15)  # prefilled once for the group
    outs = [choice(ev3, i) for i in range(3)]
    assert len({tuple(toks(o)) for o in outs}) > 1
    for o in outs:
        assert len(o) == 12
        assert_float64(ref64, group, o)


def test_torch_attention_path(tiny_model_dir, ref64):
    """With two threads the fast path attends with torch ops (batched decodes, one masked SDPA per prompt chunk)
    instead of the C kernel: a continuation that overwrites the end of a retained slot is exact there too."""
    eng = fresh_engine(tiny_model_dir, max_batch=4, max_model_len=200, max_tokens_per_step=16, threads=2)
    try:
        p1 = ids(37, start=17)
        ev1, _, _ = run(eng, "t0", p1)
        p2 = p1 + toks(ev1)[:9] + ids(20, start=44)  # cut inside the reply; the delta spans two chunks
        sp = SamplingParams(max_tokens=10, ignore_eos=True, n=2, seed=3)
        ev2, pre, reused = run(eng, "t1", p2, sp)
        assert (pre, reused) == (20, len(p1) + 9)
        for i in range(2):
            assert_float64(ref64, p2, choice(ev2, i))
    finally:
        eng.stop()
        torch.set_num_threads(1)


@pytest.mark.parametrize("mode", ["interrupt", "keep"])
def test_an_update_drops_retained_kv(tiny_model_dir, mode):
    """After an update (either mode) the next turn is prefilled again and its logprobs are the new weights' over
    the whole sequence (the contract: a request after an update's answer runs on the new weights only)."""
    eng = fresh_engine(tiny_model_dir, max_batch=4, max_model_len=200)
    w1 = perturbed(eng, seed=7)
    try:
        p1 = ids(30, start=2)
        ev1, _, _ = run(eng, "a0", p1)
        assert eng.stats()["retained"] == 1
        asyncio.run(eng.run_paused(lambda: eng.load_weights(w1, 1, mode=mode)))
        assert eng.stats()["retained"] == 0
        p2 = p1 + toks(ev1) + ids(6, start=40)
        ev2, pre, reused = run(eng, "a1", p2)
        assert (pre, reused) == (len(p2), 0)
        assert {e.version for e in ev2} == {1}
        assert_float64(ref_with(tiny_model_dir, w1), p2, ev2)
    finally:
        eng.stop()


def test_a_sequence_running_across_a_keep_update_is_not_retained(tiny_model_dir):
    """keep mode: a running sequence finishes on its old KV (by design), but that KV is not offered to the next turn."""
    eng = fresh_engine(tiny_model_dir, max_batch=4, max_model_len=200)
    w1 = perturbed(eng, seed=9)
    prompt = ids(30, start=12)

    async def across():
        out = []
        async for ev in eng.generate("span", prompt, SamplingParams(max_tokens=30, ignore_eos=True)):
            out.append(ev)
            if len(out) == 5:
                await eng.run_paused(lambda: eng.load_weights(w1, 1, mode="keep"))
        return out

    try:
        evs = asyncio.run(across())
        assert {e.version for e in evs} == {0, 1} and eng.stats()["retained"] == 0
        cont = prompt + toks(evs) + ids(6, start=3)
        ev, pre, reused = run(eng, "next", cont)
        assert (pre, reused) == (len(cont), 0)
        assert_float64(ref_with(tiny_model_dir, w1), cont, ev)
        cont2 = cont + toks(ev) + ids(4, start=8)  # "next" ran on version 1 only: retained and reused
        _, pre, reused = run(eng, "next2", cont2)
        assert (pre, reused) == (1 + 4, len(cont) + 15)
    finally:
        eng.stop()


def test_retained_slots_never_block_a_new_request(tiny_model_dir, ref64):
    """Two slots, both retained: a request for two sequences starts at once (the least recently retained one is
    evicted), and one that continues a retained sequence takes it over and evicts the other for its second choice."""
    eng = fresh_engine(tiny_model_dir, max_batch=2, max_model_len=200)
    try:
        pa, pb = ids(20, start=1), ids(20, start=30)
        eva, _, _ = run(eng, "a", pa)
        run(eng, "b", pb)
        assert eng.stats()["retained"] == 2
        pc = ids(25, start=60)
        sp = SamplingParams(max_tokens=6, ignore_eos=True, n=2, seed=1)
        evc = asyncio.run(asyncio.wait_for(collect(eng, "c", pc, sp), 60))
        assert eng.stats()["retained"] == 2  # both of c's sequences are retained in turn
        for i in range(2):
            assert_float64(ref64, pc, choice(evc, i))
        cont = pc + toks(choice(evc, 1)) + ids(5, start=7)
        evd, pre, reused = run(eng, "d", cont, sp)
        assert reused == len(pc) + 5 and pre == 1 + 5
        for i in range(2):
            assert_float64(ref64, cont, choice(evd, i))
        again = pa + toks(eva)
        ev, pre, reused = run(eng, "a-again", again)  # "a" was evicted long ago: a full prefill, still exact
        assert (pre, reused) == (len(again), 0)
        assert_float64(ref64, again, ev)
        assert eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0
    finally:
        eng.stop()


def test_generic_hf_path_reuses_whole_sequences_only(gpt2_dir):
    """The HF runner keeps a DynamicCache per slot and cannot shorten it: a continuation of the whole sequence is
    reused, a shorter common prefix is prefilled in full; both exact."""
    eng = fresh_engine(gpt2_dir, max_batch=4, max_model_len=200)
    ref = AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=torch.float32).double().eval()
    try:
        assert not eng.fast_path
        p1 = ids(24, start=3)
        ev1, _, _ = run(eng, "h0", p1)
        p2 = p1 + toks(ev1) + ids(8, start=9)
        ev2, pre, reused = run(eng, "h1", p2)
        assert (pre, reused) == (1 + 8, len(p1) + 15)
        assert_float64(ref, p2, ev2)
        p3 = p2[:-3] + ids(3, start=70)  # differs inside the retained sequence ("h1" kept p2 + its reply)
        ev3, pre, reused = run(eng, "h2", p3)
        assert (pre, reused) == (len(p3), 0)
        assert_float64(ref, p3, ev3)
    finally:
        eng.stop()


def test_slots_pick_the_longest_prefix_and_respect_min_version():
    reset = []
    s = Slots(3, reset.append, block=4)
    a, b = s.alloc(), s.alloc()
    s.release(a, list(range(10)), kv_version=3)
    s.release(b, list(range(6)) + [99, 98], kv_version=5)
    assert s.retained == 2 and s.available() == 3
    assert s.take(list(range(12)), min_version=0) == (a, 10, 3)  # the longest common prefix wins
    s.release(a, list(range(10)), kv_version=3)
    assert s.take(list(range(12)), min_version=4) == (b, 6, 5)  # a's KV is older than the request accepts
    assert s.take([7] * 12, 0) is None and s.take(list(range(4)), 0) is None  # no shared block / nothing to run
    s.release(b, [1, 2, 3], kv_version=5)  # shorter than a block: freed, not retained
    assert s.retained == 1 and b in s.free
    c, d, e = s.alloc(), s.alloc(), s.alloc()  # the third evicts a, the only retained slot
    assert {c, d, e} == {0, 1, 2} and s.retained == 0 and a in reset


def test_slots_exact_only_takes_a_whole_retained_sequence_under_a_deeper_partial_one():
    s = Slots(3, lambda slot: None, block=4, exact_only=True)
    a, b = s.alloc(), s.alloc()
    s.release(a, list(range(6)), kv_version=0)
    s.release(b, list(range(9)) + [50, 51], kv_version=0)  # shares two blocks with the prompt, but not whole
    assert s.take(list(range(9)) + [77, 78, 79], 0) == (a, 6, 0)
    assert s.take(list(range(9)) + [77, 78, 79], 0) is None
