"""The CUDA-graph decode runner (engine/model/graph_runner.py), checked on CPU by eager replay: the same buckets, static
buffers, padding rows and scratch slot, with the captured function called eagerly. Outputs against the plain engine,
buffer reuse by address, weight updates in place (addresses kept, outputs equal to a fresh engine loaded with the
pushed weights), and the loud fallback when capture fails."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.engine.core import InferenceEngine
from inflight.engine.model.graph_runner import DecodeGraphs, buckets, graphs_enabled
from inflight.engine.model.llama_runner import LlamaRunner
from inflight.engine.model.sampling import SamplingParams
from inflight.engine.scheduler.step import StepPlan
from inflight.engine.weights.receiver import WeightReceiver
from inflight.transport.layout import shm_layout
from inflight.transport.schemas import ParamInfo, WeightUpdateRequest
from inflight.transport.shm import ShmWriter, announcement_digest
from tests.engine.test_core import TOL, ids, ref_logprobs, ref_with
from tests.engine.test_decode_attention import require_triton

torch.set_num_threads(1)


def test_buckets_and_the_switch():
    assert buckets(1) == [1]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(16) == [1, 2, 4, 8, 16]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [graphs_enabled(m, cpu, None) for m in ("auto", "on", "off")] == [False, True, False]
    assert [graphs_enabled(m, cuda, None) for m in ("auto", "on", "off")] == [True, True, False]
    assert graphs_enabled("auto", cuda, "model_type 'gpt2'") is False  # the generic HF path has no graphs
    with pytest.raises(ValueError, match="fast llama"):
        graphs_enabled("on", cpu, "model_type 'gpt2'")
    with pytest.raises(ValueError, match="auto, on or off"):
        graphs_enabled("yes", cpu, None)


async def _run(eng: InferenceEngine, reqs: list[tuple[list[int], SamplingParams]]) -> list[list]:
    async def one(i, prompt, sp):
        return [(e.index, e.token_id, e.logprob, e.finish_reason, e.top_logprobs)
                async for e in eng.generate(f"r{i}", prompt, sp)]
    return await asyncio.gather(*[one(i, p, sp) for i, (p, sp) in enumerate(reqs)])


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """Staggered lengths (the batch shrinks through several buckets), n > 1, a stop token, seeded sampling."""
    out = [(ids(3 + 5 * i, start=i), SamplingParams(temperature=0.0, max_tokens=6 + 4 * i, ignore_eos=True))
           for i in range(7)]
    out.append((ids(9, start=40), SamplingParams(temperature=0.0, max_tokens=20, n=3, ignore_eos=True)))
    out.append((ids(5, start=50), SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[4, 5, 6, 7, 8])))
    out.append((ids(6, start=60), SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=15,
                                                 ignore_eos=True, top_logprobs=3)))
    return out


def _assert_same(a: list[list], b: list[list], tol: float) -> None:
    for x, y in zip(a, b, strict=True):
        assert [(e[0], e[1], e[3]) for e in x] == [(e[0], e[1], e[3]) for e in y]  # token for token, same ends
        assert max(abs(p[2] - q[2]) for p, q in zip(x, y)) <= tol
        for p, q in zip(x, y):
            if p[4]:
                assert [t for t, _ in p[4]] == [t for t, _ in q[4]]
                assert max(abs(u - v) for (_, u), (_, v) in zip(p[4], q[4])) <= tol


@pytest.mark.parametrize("device_sampling", [False, True])
def test_eager_replay_matches_the_plain_engine(tiny_model_dir, device_sampling):
    results, replays = [], None
    for mode in ("off", "on"):
        eng = InferenceEngine(str(tiny_model_dir), max_batch=12, max_model_len=96, cuda_graphs=mode,
                              device_sampling=device_sampling and mode == "on")
        eng.start()
        try:
            results.append(asyncio.run(_run(eng, _requests())))
            if mode == "on":
                replays = dict(eng.graphs.replays)
                assert eng.graphs.status == "eager replay" and eng.graphs.attention == "masked"
        finally:
            eng.stop()
    _assert_same(results[0], results[1], tol=1e-5)
    assert len(replays) >= 3 and set(replays) <= {1, 2, 4, 8, 12}, replays  # the batch went through buckets
    assert sum(replays.values()) >= 20


@pytest.fixture()
def runner(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False)
    r = LlamaRunner(model, max_batch=9, max_model_len=64)  # 8 slots for sequences + the scratch slot
    r.pin_storage()
    return r


def test_static_buffers_are_reused_and_padding_writes_only_the_scratch_slot(runner):
    graphs = DecodeGraphs(runner, max_batch=8, capture=False)
    g = torch.Generator().manual_seed(0)
    runner.kv.copy_(torch.randn(runner.kv.shape, generator=g))  # a filled cache: padding must not touch it
    addr = {"inputs": graphs.inputs.data_ptr(), **{b: t.data_ptr() for b, t in graphs.logits.items()}}
    for n in (3, 1, 5, 8, 3, 2, 5):
        slots = torch.randperm(8, generator=g)[:n].tolist()
        positions = torch.randint(1, 60, (n,), generator=g).tolist()
        tokens = torch.randint(4, 80, (n,), generator=g).tolist()
        before = runner.kv.clone()
        logits = graphs.decode(tokens, positions, slots)
        b = graphs.bucket(n)
        assert logits.shape[0] == n and logits.data_ptr() == graphs.logits[b].data_ptr()  # a view, no new buffer
        written = torch.zeros(runner.kv.shape[2:4] + runner.kv.shape[4:5], dtype=torch.bool)  # [slots, kv, T]
        for s, p in zip(slots, positions):
            written[s, :, p] = True
        changed = (runner.kv != before).any(-1).any(0).any(0)  # [slots, kv, T]
        assert changed[written].all()  # every row's k and v at its position
        written[graphs.scratch, :, 0] = True  # padding rows: position 0 of the scratch slot (the same k, v each time)
        assert not (changed & ~written).any(), ((changed & ~written).nonzero()[:8].tolist(), slots, positions)
        # the same step through the plain forward, from the cache as it was
        runner.kv.copy_(before)
        plan = StepPlan.build([(s, p, [t]) for s, p, t in zip(slots, positions, tokens)], [True] * n, runner.device)
        want = runner.forward(plan)
        assert (logits - want).abs().max().item() < 1e-4
    assert addr == {"inputs": graphs.inputs.data_ptr(), **{b: t.data_ptr() for b, t in graphs.logits.items()}}
    assert dict(graphs.replays) == {4: 2, 1: 1, 8: 3, 2: 1}


def test_a_failed_capture_falls_back_to_eager_and_says_why(runner, caplog):
    """Capturing on a CPU model fails for real (no CUDA device): the runner logs an error and decodes eagerly."""
    with caplog.at_level(logging.ERROR, logger="inflight.engine.model.graph_runner"):
        graphs = DecodeGraphs(runner, max_batch=8, capture=True)
    assert graphs.status.startswith("eager (CUDA graph capture failed: RuntimeError")
    assert not graphs.graphs
    assert any("capture failed" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    logits = graphs.decode([5, 6], [0, 0], [0, 1])
    assert logits.shape == (2, runner.gen.head.shape[0]) and torch.isfinite(logits).all()


def test_a_failed_capture_with_the_triton_attention_retries_with_the_masked_one(runner, caplog):
    """With Triton (the test extra installs it on Linux): the split kernel is tried first, then the masked
    attention, each failure logged."""
    require_triton()
    with caplog.at_level(logging.ERROR, logger="inflight.engine.model.graph_runner"):
        graphs = DecodeGraphs(runner, max_batch=8, capture=True, attention="split")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "trying the masked attention" in errors[0] and "capture failed" in errors[1]
    assert graphs.attention == "masked" and graphs.status.startswith("eager (CUDA graph capture failed")


# ---- weight updates keep the graphs valid -------------------------------------------------------------------------
def addresses(eng: InferenceEngine) -> dict[str, int]:
    """Every storage a captured graph would read: parameters, the generator's tensors, the KV cache, the buffers."""
    r, G = eng.runner, eng.runner.gen
    out = {f"param {n}": p.data_ptr() for n, p in eng.model.named_parameters()}
    out.update({"kv": r.kv.data_ptr(), "cos": r.cos.data_ptr(), "gen embed": G.embed.data_ptr(),
                "gen norm": G.norm.data_ptr(), "gen head": G.head.data_ptr(), "inputs": eng.graphs.inputs.data_ptr()})
    for i, L in enumerate(G.layers):
        out.update({f"gen {i} {k}": v.data_ptr() for k, v in L.items() if isinstance(v, torch.Tensor)})
    out.update({f"logits {b}": t.data_ptr() for b, t in eng.graphs.logits.items()})
    return out


def perturbed(eng: InferenceEngine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in eng.model.named_parameters()}


def _greedy(eng: InferenceEngine) -> list[list]:
    reqs = [(ids(7, start=3), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)),
            (ids(4, start=30), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))]
    return [asyncio.run(_run(eng, [r]))[0] for r in reqs]  # one at a time: the same batches in both engines


def _fresh(tiny_model_dir, tmp_path, weights: dict[str, torch.Tensor], precision: str) -> list[list]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    out = tmp_path / f"fresh-{len(list(tmp_path.iterdir()))}"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    eng = InferenceEngine(str(out), max_batch=4, max_model_len=64, cuda_graphs="on", generator_precision=precision)
    eng.start()
    try:
        return _greedy(eng)
    finally:
        eng.stop()


def shm_push(receiver: WeightReceiver, writer: ShmWriter, weights: dict[str, torch.Tensor], version: int) -> None:
    params = [ParamInfo(name=n, shape=list(t.shape), dtype="float32") for n, t in weights.items()]
    offsets, data_bytes = shm_layout(params)
    seg = writer.write(list(weights.items()), ["float32"] * len(params), offsets, data_bytes, version,
                       announcement_digest(params))
    asyncio.run(receiver.update(WeightUpdateRequest(version=version, params=params, shm=seg)))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_weight_updates_copy_in_place_and_match_a_fresh_engine(tiny_model_dir, tmp_path, precision):
    """A full update from a file, a LoRA adapter (merged, then swapped: copied in place here) and a shared-memory
    update (staged on CPU without graphs): after each, no storage moved, and greedy outputs equal those of a fresh
    engine loaded with the weights the push produced."""
    eng = InferenceEngine(str(tiny_model_dir), max_batch=4, max_model_len=64, cuda_graphs="on",
                          generator_precision=precision)
    receiver, writer = WeightReceiver(eng), ShmWriter(str(tmp_path))
    assert not eng.runner.double_buffer  # no staging into spare storage: it would move the weights
    eng.start()
    try:
        before, gen = addresses(eng), eng.runner.gen
        _greedy(eng)
        w1 = perturbed(eng, seed=1)
        save_file(w1, str(tmp_path / "w1.safetensors"))
        asyncio.run(receiver.update(WeightUpdateRequest(version=1, path=str(tmp_path / "w1.safetensors"))))
        assert addresses(eng) == before and eng.runner.gen is gen
        assert _greedy(eng) == _fresh(tiny_model_dir, tmp_path, w1, precision)

        q = "model.layers.0.self_attn.q_proj.weight"
        g = torch.Generator().manual_seed(2)
        a, b = 0.3 * torch.randn(2, w1[q].shape[1], generator=g), 0.3 * torch.randn(w1[q].shape[0], 2, generator=g)
        save_file({q + ".lora_A": a, q + ".lora_B": b}, str(tmp_path / "a.safetensors"))
        asyncio.run(receiver.update(WeightUpdateRequest(version=2, path=str(tmp_path / "a.safetensors"),
                                                        adapter={"rank": 2, "scaling": 0.5})))
        assert addresses(eng) == before and eng.runner.gen is gen
        merged = {**w1, q: torch.addmm(w1[q], b, a, alpha=0.5)}
        assert torch.allclose(dict(eng.model.named_parameters())[q], merged[q], atol=1e-6)
        assert _greedy(eng) == _fresh(tiny_model_dir, tmp_path, merged, precision)

        w3 = perturbed(eng, seed=3)
        shm_push(receiver, writer, w3, version=3)
        assert addresses(eng) == before and eng.runner.gen is gen
        assert _greedy(eng) == _fresh(tiny_model_dir, tmp_path, w3, precision)
        assert eng.version == 3
    finally:
        eng.stop()
        writer.discard()


@pytest.mark.parametrize("mode", ["interrupt", "keep"])
def test_update_during_generation_through_the_graph_runner(tiny_model_dir, mode):
    """Keep and interrupt behave as on the plain path (tests/engine/test_core.py): tokens before the update match
    the old weights, after it (interrupt) the new weights over the whole prefix, or (keep) not quite, since the
    prefix KV was computed by the old weights."""
    eng = InferenceEngine(str(tiny_model_dir), max_batch=4, max_model_len=96, cuda_graphs="on")
    new = perturbed(eng, seed=5)
    prompt = ids(12)
    eng.start()

    async def main():
        out = []
        async for ev in eng.generate("span", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)):
            out.append(ev)
            if len(out) == 8:
                await eng.run_paused(lambda: eng.load_weights(new, 1, mode=mode))
        return out

    try:
        evs = asyncio.run(main())
        assert sum(eng.graphs.replays.values()) >= 20
    finally:
        eng.stop()
    versions = [e.version for e in evs]
    k = versions.index(1)
    assert k >= 8 and versions == [0] * k + [1] * (30 - k)
    toks = [e.token_id for e in evs]
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).double().eval()
    got = torch.tensor([e.logprob for e in evs], dtype=torch.float64)
    assert (got[:k] - ref_logprobs(old, prompt, toks[:k])).abs().max() < TOL
    fresh = ref_logprobs(ref_with(tiny_model_dir, new), prompt, toks)[k:]
    if mode == "interrupt":
        assert (got[k:] - fresh).abs().max() < TOL
    else:
        assert (got[k:] - fresh).abs().max() > 1e-3


def test_the_switch_is_a_server_option():
    """`server.cuda_graphs` reaches `inflight serve --cuda-graphs` (as generator_precision does), and the serve
    parser takes it."""
    import argparse

    from inflight.config import RunConfig, load_config
    from inflight.engine import serve
    from inflight.pipeline.launch_common import server_command

    for value, flag in (("off", "off"), ("on", "on"), ("false", "off"), ("true", "on")):  # YAML's bare on/off: bools
        argv = server_command(load_config(RunConfig, None, [f"server.cuda_graphs={value}"]), 0)
        assert argv[argv.index("--cuda-graphs") + 1] == flag
    with pytest.raises(ValueError, match="auto, on or off"):
        load_config(RunConfig, None, ["server.cuda_graphs=sometimes"])
    assert "--cuda-graphs" not in server_command(load_config(RunConfig, None, []), 0)  # auto: the default
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    assert p.parse_args(["--model", "m", "--cuda-graphs", "on"]).cuda_graphs == "on"
    assert p.parse_args(["--model", "m"]).cuda_graphs == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--cuda-graphs", "always"])
