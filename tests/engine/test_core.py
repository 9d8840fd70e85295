"""InferenceEngine against independent float64 transformers forwards of the same weights."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.engine.core import InferenceEngine, SamplingParams, TokenEvent, VersionNotReached

torch.set_num_threads(1)
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = InferenceEngine(str(tiny_model_dir), max_batch=16, max_model_len=160, max_tokens_per_step=64)
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def ref64(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).double().eval()


def fresh_engine(path, **kw) -> InferenceEngine:
    eng = InferenceEngine(str(path), max_batch=kw.pop("max_batch", 8), max_model_len=kw.pop("max_model_len", 160), **kw)
    eng.start()
    return eng


async def collect(eng: InferenceEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[TokenEvent]:
    return [ev async for ev in eng.generate(rid, prompt, params)]


def choice(events: list[TokenEvent], i: int) -> list[TokenEvent]:
    return [e for e in events if e.index == i]


def ref_logprobs(model, prompt: list[int], toks: list[int], temperature: float = 1.0) -> torch.Tensor:
    """float64 log p(tok_t | prefix) from a plain forward over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + toks])).logits[0].double()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return lp.gather(1, torch.tensor(toks)[:, None])[:, 0]


def assert_logprobs_match(model, prompt, events, temperature=1.0):
    toks = [e.token_id for e in events if e.token_id >= 0]
    got = torch.tensor([e.logprob for e in events if e.token_id >= 0], dtype=torch.float64)
    want = ref_logprobs(model, prompt, toks, temperature)
    assert (got - want).abs().max().item() < TOL, (got - want).abs().max().item()


def weight_hash(eng: InferenceEngine) -> str:
    h = hashlib.sha256()
    for name, p in sorted(eng.model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def ids(n: int, start: int = 4) -> list[int]:
    return [4 + (start + i) % 76 for i in range(n)]  # inside the 82-token vocabulary, no special tokens


PROMPTS = [[4, 5, 6], [10, 20, 30, 40, 50, 11, 12, 13, 14, 15, 16, 17], [7], ids(80)]


def test_logprobs_match_hf_concurrent_joining_mid_run(engine, ref64):
    async def main():
        long = asyncio.create_task(collect(engine, "long", PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0)
        while engine.stats()["generated_tokens_total"] < 5:  # the long one is decoding when the others join
            await asyncio.sleep(0.005)
        others = [collect(engine, f"j{i}", p, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.7))
                  for i, p in enumerate(PROMPTS[1:])]
        return await long, await asyncio.gather(*others)

    long, others = asyncio.run(main())
    assert len(long) == 40 and long[-1].finish_reason == "length"
    assert_logprobs_match(ref64, PROMPTS[0], long)
    for p, evs in zip(PROMPTS[1:], others):  # the 80-token prompt needs two prefill chunks (budget 64)
        assert len(evs) == 12
        assert_logprobs_match(ref64, p, evs, temperature=0.7)


def test_queueing_slot_reuse_and_chunking(tiny_model_dir, ref64):
    """More sequences than slots, small token budget: every choice completes and stays exact (reused slots)."""
    eng = fresh_engine(tiny_model_dir, max_batch=6, max_tokens_per_step=20)
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(18):
        plen, mt, n = (int(x) for x in (torch.randint(1, 50, (1,), generator=g), torch.randint(1, 15, (1,), generator=g),
                                       torch.randint(1, 4, (1,), generator=g)))
        reqs.append((ids(plen, start=7 * i), SamplingParams(max_tokens=mt, n=n, ignore_eos=True)))

    async def main():
        return await asyncio.gather(*[collect(eng, f"q{i}", p, sp) for i, (p, sp) in enumerate(reqs)])

    try:
        results = asyncio.run(main())
        assert eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0
    finally:
        eng.stop()
    for (p, sp), evs in zip(reqs, results):
        for i in range(sp.n):
            c = choice(evs, i)
            assert len(c) == sp.max_tokens and c[-1].finish_reason == "length"
            assert_logprobs_match(ref64, p, c)


def test_lower_priority_value_starts_first(tiny_model_dir):
    """Slots full: waiting requests start by priority (lower first), arrival order within one; a waiting request
    whose n does not fit yet is not overtaken by smaller ones behind it."""
    eng = fresh_engine(tiny_model_dir, max_batch=4)
    started: list[str] = []

    async def one(rid: str, n: int, priority: int, max_tokens: int = 3):
        async for ev in eng.generate(rid, ids(4, start=3), SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True,
                                                                           priority=priority)):
            if rid not in started:
                started.append(rid)

    async def main():
        blocker = asyncio.ensure_future(one("busy", 4, 0, max_tokens=40))  # holds every slot for 40 steps
        while "busy" not in started:
            await asyncio.sleep(0.001)
        queued = [("eval-a", 1, 1), ("eval-b", 1, 1), ("train", 4, 0), ("eval-c", 1, 1), ("urgent", 1, -1)]
        await asyncio.gather(blocker, *(one(*q) for q in queued))

    try:
        asyncio.run(main())
    finally:
        eng.stop()
    assert started == ["busy", "urgent", "train", "eval-a", "eval-b", "eval-c"], started


def test_n_samples_share_prefill_and_match(engine, ref64):
    prompt = PROMPTS[1]
    before = engine.stats()["prefill_tokens_total"]
    evs = asyncio.run(collect(engine, "n4", prompt, SamplingParams(n=4, max_tokens=10, ignore_eos=True, seed=3)))
    assert engine.stats()["prefill_tokens_total"] - before == len(prompt)  # prefilled once, not 4 times
    outs = [choice(evs, i) for i in range(4)]
    assert all(len(o) == 10 and o[-1].finish_reason == "length" for o in outs)
    assert len({tuple(e.token_id for e in o) for o in outs}) > 1  # the choices sample independently
    for o in outs:
        assert_logprobs_match(ref64, prompt, o)


def test_top_k_top_p_logprobs_are_renormalised(engine, ref64):
    prompt = PROMPTS[1]
    t, k, p = 0.8, 5, 0.6
    evs = asyncio.run(collect(engine, "tk", prompt, SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=8,
                                                                   ignore_eos=True, top_logprobs=3)))
    toks = [e.token_id for e in evs]
    with torch.no_grad():
        logits = ref64(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : -1].double()
    for row, ev in zip(logits, evs):  # float64 reference: temperature, top-k, then smallest set with mass >= p
        probs = torch.softmax(row / t, -1)
        sp, si = probs.sort(descending=True)
        keep = (torch.cumsum(sp, 0) - sp < p) & (torch.arange(len(sp)) < k)
        kept = dict(zip(si[keep].tolist(), (sp[keep] / sp[keep].sum()).tolist()))
        assert ev.token_id in kept
        assert abs(ev.logprob - torch.log(torch.tensor(kept[ev.token_id])).item()) < TOL
        assert ev.top_logprobs[0][0] == si[0].item()
        assert all(tok in kept for tok, _ in ev.top_logprobs)


def test_greedy_equals_hf_generate(engine, tiny_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    async def main():
        return await asyncio.gather(*[collect(engine, f"g{i}", p, SamplingParams(temperature=0, max_tokens=15,
                                                                                  ignore_eos=True))
                                      for i, p in enumerate(PROMPTS)])

    for p, evs in zip(PROMPTS, asyncio.run(main())):
        want = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=15, min_new_tokens=15)[0, len(p) :]
        assert [e.token_id for e in evs] == want.tolist()


def test_seed_reproducible_regardless_of_neighbours(engine):
    sp = SamplingParams(seed=1234, max_tokens=20, ignore_eos=True, n=2)
    alone = asyncio.run(collect(engine, "s", PROMPTS[1], sp))

    async def crowded():
        noise = [collect(engine, f"noise{i}", p, SamplingParams(max_tokens=25, ignore_eos=True))
                 for i, p in enumerate(PROMPTS)]
        res = await asyncio.gather(*noise[:2], collect(engine, "s", PROMPTS[1], sp), *noise[2:])
        return res[2]

    again = asyncio.run(crowded())
    for i in range(2):
        assert [e.token_id for e in choice(alone, i)] == [e.token_id for e in choice(again, i)]
    other = asyncio.run(collect(engine, "s", PROMPTS[1], SamplingParams(seed=99, max_tokens=20, ignore_eos=True)))
    assert [e.token_id for e in other] != [e.token_id for e in choice(alone, 0)]


def test_stream_false_hands_over_everything_once_at_the_end(engine):
    """The same seeded tokens and logprobs as streaming; the first event arrives only once the request has ended
    (its id is free again), where a streaming consumer sees its first token while the request still runs."""
    sp = SamplingParams(seed=7, max_tokens=30, ignore_eos=True, n=2)

    async def run(rid: str, stream: bool) -> tuple[list[TokenEvent], bool]:
        events, running_at_first = [], None
        async for ev in engine.generate(rid, PROMPTS[1], sp, stream=stream):
            if running_at_first is None:
                with engine._cv:
                    running_at_first = rid in engine._ids
            events.append(ev)
        return events, running_at_first

    streamed, streamed_running = asyncio.run(run("st1", True))
    held, held_running = asyncio.run(run("st2", False))
    assert streamed_running and not held_running
    for i in range(2):
        a, b = choice(streamed, i), choice(held, i)
        assert [e.token_id for e in a] == [e.token_id for e in b] and len(a) == 30
        assert [e.logprob for e in a] == [e.logprob for e in b]
        assert b[-1].finish_reason == "length" and all(e.finish_reason is None for e in b[:-1])


def test_stop_token_and_max_tokens(engine):
    free = asyncio.run(collect(engine, "f", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    toks = [e.token_id for e in free]
    i = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])  # first fresh token after the first
    stopped = asyncio.run(collect(engine, "st", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20,
                                                                          stop_token_ids=[toks[i]])))
    assert [e.token_id for e in stopped] == toks[: i + 1]
    assert stopped[-1].finish_reason == "stop" and all(e.finish_reason is None for e in stopped[:-1])
    short = asyncio.run(collect(engine, "mt", PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert len(short) == 3 and short[-1].finish_reason == "length"
    # the context limit also ends a generation with "length"
    near = ids(155)
    capped = asyncio.run(collect(engine, "ctx", near, SamplingParams(max_tokens=50, ignore_eos=True)))
    assert len(capped) == 160 - 155 and capped[-1].finish_reason == "length"


def test_bad_requests_raise(engine):
    async def first(prompt, sp):
        return await anext(engine.generate("bad", prompt, sp))

    for prompt, sp in [([], SamplingParams()), ([1] * 160, SamplingParams()), ([10_000], SamplingParams()),
                       ([5], SamplingParams(n=0)), ([5], SamplingParams(top_p=0)), ([5], SamplingParams(max_tokens=0)),
                       ([5], SamplingParams(temperature=-1)), ([5], SamplingParams(top_logprobs=50))]:
        with pytest.raises(ValueError):
            asyncio.run(first(prompt, sp))


def test_abort_and_cancel_free_slots(engine):
    async def main():
        got = []
        async for ev in engine.generate("ab", PROMPTS[0], SamplingParams(max_tokens=150, ignore_eos=True)):
            got.append(ev)
            if len(got) == 3:
                engine.abort("ab")
        # a consumer that goes away mid-generation frees its slot too
        task = asyncio.create_task(collect(engine, "cx", PROMPTS[0], SamplingParams(max_tokens=150, ignore_eos=True)))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.002)
        task.cancel()
        for _ in range(500):
            if engine.stats()["running"] == 0:
                break
            await asyncio.sleep(0.01)
        return got

    got = asyncio.run(main())
    assert 3 <= len(got) < 150
    assert got[-1].finish_reason == "abort" and got[-1].token_id == -1
    assert engine.stats()["running"] == 0


def test_abort_before_any_token_gives_final_events(engine):
    async def main():
        entered, gate = threading.Event(), threading.Event()
        hold = asyncio.create_task(engine.run_paused(lambda: (entered.set(), gate.wait(10))))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        task = asyncio.create_task(collect(engine, "early", PROMPTS[1], SamplingParams(n=2, max_tokens=5)))
        await asyncio.sleep(0.02)  # the request is queued while the engine is held
        engine.abort("early")
        gate.set()
        await hold
        return await task

    evs = asyncio.run(main())
    assert sorted((e.index, e.token_id, e.finish_reason) for e in evs) == [(0, -1, "abort"), (1, -1, "abort")]


def perturbed(eng: InferenceEngine, scale: float = 0.3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in eng.model.named_parameters()}


def ref_with(path, tensors) -> torch.nn.Module:
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.load_state_dict(tensors, strict=False)
    return m.double().eval()


def test_weight_update_then_logprobs_match_new_weights(tiny_model_dir):
    eng = fresh_engine(tiny_model_dir)
    try:
        new = perturbed(eng)
        asyncio.run(eng.run_paused(lambda: eng.load_weights(new, 7)))
        assert eng.version == 7 and eng.stats()["version"] == 7
        evs = asyncio.run(collect(eng, "after", PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True, n=2)))
        assert {e.version for e in evs} == {7}
        for i in range(2):
            assert_logprobs_match(ref_with(tiny_model_dir, new), PROMPTS[1], choice(evs, i))
        assert eng.stats()["paused_seconds_total"] > 0
    finally:
        eng.stop()


@pytest.mark.parametrize("mode", ["interrupt", "keep"])
def test_update_during_generation(tiny_model_dir, ref64, mode):
    eng = fresh_engine(tiny_model_dir)
    new = perturbed(eng, seed=1)
    prompt = PROMPTS[1]

    async def main():
        out = []
        async for ev in eng.generate("span", prompt, SamplingParams(max_tokens=40, ignore_eos=True)):
            out.append(ev)
            if len(out) == 8:
                await eng.run_paused(lambda: eng.load_weights(new, 1, mode=mode))
        return out

    try:
        evs = asyncio.run(main())
    finally:
        eng.stop()
    versions = [e.version for e in evs]
    k = versions.index(1)  # first token of the new weights
    assert k >= 8 and versions == [0] * k + [1] * (40 - k)
    toks = [e.token_id for e in evs]
    old_part = torch.tensor([e.logprob for e in evs[:k]], dtype=torch.float64)
    assert (old_part - ref_logprobs(ref64, prompt, toks[:k])).abs().max() < TOL
    got = torch.tensor([e.logprob for e in evs[k:]], dtype=torch.float64)
    fresh = ref_logprobs(ref_with(tiny_model_dir, new), prompt, toks)[k:]  # new weights over the whole prefix
    if mode == "interrupt":
        assert (got - fresh).abs().max() < TOL
    else:  # keep: the prefix KV was computed by the old weights
        assert (got - fresh).abs().max() > 1e-3


def test_a_held_request_starts_with_the_weights_it_asked_for(tiny_model_dir, ref64):
    """min_version: the request waits on the engine thread (no slot, no token) while others run, and its first token
    comes from the weights of the pause that brings that version. One that never gets them fails with
    VersionNotReached at its deadline; one whose consumer goes away leaves nothing behind."""
    eng = fresh_engine(tiny_model_dir)
    new = perturbed(eng, seed=2)
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    async def main():
        held = asyncio.create_task(collect_gated(eng, "held", prompt, params, min_version=1))
        plain = await collect(eng, "plain", prompt, params)  # runs to its end beside the held one
        stats = eng.stats()
        assert not held.done() and stats["running"] == 0 and stats["waiting"] == 1
        await eng.run_paused(lambda: eng.load_weights(new, 1))
        return plain, await held

    async def never():
        t0 = time.monotonic()
        with pytest.raises(VersionNotReached, match="min_weight_version 9"):
            await collect_gated(eng, "never", prompt, params, min_version=9, version_wait_s=0.3)
        return time.monotonic() - t0

    async def walk_away():
        task = asyncio.create_task(collect_gated(eng, "gone", prompt, params, min_version=9))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):
            if eng.stats()["waiting"] == 0:
                break
            await asyncio.sleep(0.01)

    try:
        plain, held = asyncio.run(main())
        assert {e.version for e in plain} == {0}
        assert_logprobs_match(ref64, prompt, plain)
        assert [e.version for e in held] == [1] * 10
        assert_logprobs_match(ref_with(tiny_model_dir, new), prompt, held)
        assert 0.3 <= asyncio.run(never()) < 5
        asyncio.run(walk_away())
        assert eng.stats()["waiting"] == 0 and eng.stats()["running"] == 0
        assert len(asyncio.run(collect(eng, "after", prompt, params))) == 10  # the engine still serves
    finally:
        eng.stop()


async def collect_gated(eng, rid, prompt, params, **gate) -> list[TokenEvent]:
    return [ev async for ev in eng.generate(rid, prompt, params, **gate)]


def test_bad_load_weights_changes_nothing(tiny_model_dir):
    eng = fresh_engine(tiny_model_dir)
    try:
        before = weight_hash(eng)
        specs = eng.param_specs()
        name = "model.layers.0.self_attn.q_proj.weight"
        assert name in specs and specs[name][1] == torch.float32
        good = {n: torch.zeros(s) for n, (s, _) in list(specs.items())[:3]}
        for bad in [{**good, "nope.weight": torch.zeros(3)}, {**good, name: torch.zeros(3, 3)}]:
            with pytest.raises(ValueError):
                asyncio.run(eng.run_paused(lambda: eng.load_weights(bad, 5)))
            assert weight_hash(eng) == before and eng.version == 0
        with pytest.raises(RuntimeError):  # outside run_paused
            eng.load_weights(good, 5)
        assert weight_hash(eng) == before
        # the engine still serves afterwards
        assert len(asyncio.run(collect(eng, "ok", PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True)))) == 4
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def gpt2_dir(tiny_model_dir, tmp_path_factory):
    """A non-llama architecture (GPT-2), so the engine takes its generic HF path."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    out = tmp_path_factory.mktemp("tiny_gpt2")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=256,
                     eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_generic_hf_path_matches(gpt2_dir, caplog):
    with caplog.at_level("WARNING", logger="inflight.engine.core"):
        eng = fresh_engine(gpt2_dir, max_tokens_per_step=32)
    ref = AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=torch.float32).double().eval()
    assert not eng.fast_path
    said = [r.getMessage() for r in caplog.records if r.name == "inflight.engine.core"]
    assert len(said) == 1 and "model_type 'gpt2'" in said[0] and "generic HF forward" in said[0], said

    async def main():
        return await asyncio.gather(*[collect(eng, f"h{i}", p, SamplingParams(max_tokens=10, ignore_eos=True, n=2))
                                      for i, p in enumerate(PROMPTS)])

    try:
        for p, evs in zip(PROMPTS, asyncio.run(main())):
            for i in range(2):
                assert len(choice(evs, i)) == 10
                assert_logprobs_match(ref, p, choice(evs, i))
    finally:
        eng.stop()


def test_interrupt_stress_every_token_matches_its_version(tiny_model_dir):
    """Many interrupt updates while requests join, prefill in chunks and fork n>1: in interrupt mode every
    token's logprob must equal a fresh forward, over its whole prefix, of the weights of the version it carries."""
    eng = fresh_engine(tiny_model_dir, max_batch=12, max_tokens_per_step=9)
    weights = {v: perturbed(eng, scale=0.3, seed=100 + v) for v in range(1, 7)}
    reqs = [(f"r{i}", ids(3 + 7 * i, start=5 * i), SamplingParams(max_tokens=14 + 3 * i, ignore_eos=True, n=1 + i % 3,
                                                                   seed=i)) for i in range(6)]

    async def updater():
        for v in range(1, 7):
            await asyncio.sleep(0.004 * v)
            await eng.run_paused(lambda v=v: eng.load_weights(weights[v], v, mode="interrupt"))

    async def main():
        async def late(i, r):
            await asyncio.sleep(0.003 * i)  # requests join while others decode and updates land
            return await collect(eng, *r)

        up = asyncio.create_task(updater())
        outs = await asyncio.gather(*[late(i, r) for i, r in enumerate(reqs)])
        await up
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        eng.stop()
    refs = {0: None}
    versions_seen = set()
    worst = 0.0
    for (_, prompt, sp), evs in zip(reqs, outs):
        for i in range(sp.n):
            evc = choice(evs, i)
            assert len(evc) == sp.max_tokens
            toks = [e.token_id for e in evc]
            for t, e in enumerate(evc):
                versions_seen.add(e.version)
                if e.version not in refs:
                    refs[e.version] = ref_with(tiny_model_dir, weights[e.version])
                m = refs[e.version]
                if m is None:
                    m = refs[0] = AutoModelForCausalLM.from_pretrained(tiny_model_dir).double().eval()
                want = ref_logprobs(m, prompt, toks[: t + 1])[-1].item()
                worst = max(worst, abs(e.logprob - want))
    assert len(versions_seen) >= 3, versions_seen  # the updates really landed mid-generation
    assert worst < TOL, worst


def test_interrupt_lands_with_admission_and_mid_chunked_prefill(tiny_model_dir):
    """The update is applied in the same engine iteration that admits new requests, and again while a long n=2
    prompt is half-way through its chunked prefill: every token still matches a fresh forward of its version."""
    eng = fresh_engine(tiny_model_dir, max_tokens_per_step=8)
    w1, w2 = perturbed(eng, seed=31), perturbed(eng, seed=32)
    long_prompt = ids(140, start=3)
    mid, queued = threading.Event(), threading.Event()
    step = eng._step

    def step_then_wait_mid_prefill():  # the engine thread waits, once, until the second update is queued
        step()
        if not mid.is_set() and eng.stats()["prefill_tokens_total"] >= 30:  # 8 prompt tokens per step
            mid.set()
            queued.wait(10)

    eng._step = step_then_wait_mid_prefill

    async def main():
        entered, gate = threading.Event(), threading.Event()
        hold = asyncio.create_task(eng.run_paused(lambda: (entered.set(), gate.wait(10))))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        a = asyncio.create_task(collect(eng, "a", PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True)))
        b = asyncio.create_task(collect(eng, "b", long_prompt, SamplingParams(max_tokens=6, ignore_eos=True, n=2)))
        await asyncio.sleep(0.02)  # both queued behind the held engine
        upd = asyncio.create_task(eng.run_paused(lambda: eng.load_weights(w1, 1, mode="interrupt")))
        await asyncio.sleep(0.02)
        gate.set()  # next iteration: the update, then both admissions
        await hold, upd
        await asyncio.get_running_loop().run_in_executor(None, mid.wait, 10)
        upd2 = asyncio.create_task(eng.run_paused(lambda: eng.load_weights(w2, 2, mode="interrupt")))
        await asyncio.sleep(0)  # run_paused has queued the update
        queued.set()
        await upd2
        return await a, await b

    try:
        ev_a, ev_b = asyncio.run(main())
    finally:
        eng.stop()
    refs = {1: ref_with(tiny_model_dir, w1), 2: ref_with(tiny_model_dir, w2)}
    assert ev_a[0].version == 1 and {e.version for e in ev_b} == {2}
    for prompt, evs in [(PROMPTS[1], ev_a), (long_prompt, choice(ev_b, 0)), (long_prompt, choice(ev_b, 1))]:
        toks = [e.token_id for e in evs]
        for t, e in enumerate(evs):
            want = ref_logprobs(refs[e.version], prompt, toks[: t + 1])[-1].item()
            assert abs(e.logprob - want) < TOL, (t, e.version, e.logprob, want)


def test_step_trace_records_each_steps_decodes_context_and_prefill(tiny_model_dir):
    """The profiler's view of a step (inflight_plan/traffic.py): one request, n=2, 6-token prompt, 4 tokens each."""
    eng = fresh_engine(tiny_model_dir)
    try:
        eng.step_trace = []
        asyncio.run(collect(eng, "t", [5, 6, 7, 8, 9, 10], SamplingParams(n=2, max_tokens=4, ignore_eos=True)))
        trace, eng.step_trace = eng.step_trace, None
    finally:
        eng.stop()
    # the prompt prefilled once (both choices sample from it), then 3 steps of 2 decodes at lengths 7, 8, 9
    assert [t[:3] for t in trace] == [(0, 0, 6), (2, 14, 0), (2, 16, 0), (2, 18, 0)]
    assert all(0 < t[3] < 5.0 for t in trace)
