"""InferenceEngine against independent float64 transformers forwards of the same weights."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.engine.core import InferenceEngine, SamplingParams, TokenEvent

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


def test_generic_hf_path_matches(gpt2_dir):
    eng = fresh_engine(gpt2_dir, max_tokens_per_step=32)
    ref = AutoModelForCausalLM.from_pretrained(gpt2_dir, dtype=torch.float32).double().eval()
    assert not eng.fast_path

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
