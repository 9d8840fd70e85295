"""Adapter (LoRA) updates on the built-in engine (docs/inference-contract.md, "Adapter updates"): this test process is
trainer rank 0 over a real gloo group, the server is `inflight serve` in a subprocess. After an adapter push the
server's logprobs equal a float64 HF forward of W0 + s * B @ A (merged here, plainly); an adapter replaces the
previous one whole; a full push drops it; malformed adapters are refused with nothing changed."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json

import httpx
import pytest
import torch
from safetensors.torch import save_file

from inflight.trainer.weight_sync.inflight import WeightSyncClient
from inflight.transport.layout import bucket_layout, packed_bytes
from inflight.transport.schemas import ParamInfo
from tests.engine.test_core import gpt2_dir  # noqa: F401  (a fixture: a GPT-2 model, the generic HF path)
from tests.servers import generation_across_update, model_of, serve_model

torch.set_num_threads(1)
MSG = [{"role": "user", "content": "3+4="}]
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
Q0, V1, D0 = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
              "model.layers.0.mlp.down_proj.weight")
O1 = "model.layers.1.self_attn.o_proj.weight"


# ---- helpers: weights, the float64 reference, pushes ------------------------------------------------------------
def base_weights(model_dir, seed: int) -> dict[str, torch.Tensor]:
    """The saved weights, perturbed by `seed` (float32, by parameter name; a tied alias is not a parameter)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.02 * torch.randn(p.shape, generator=g) for n, p in hf.named_parameters()}


def make_adapter(w0: dict, bases: list[str], rank: int, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for b in bases:
        n_out, n_in = w0[b].shape
        out[b + ".lora_A"] = scale * torch.randn(rank, n_in, generator=g)
        out[b + ".lora_B"] = scale * torch.randn(n_out, rank, generator=g)
    return out


def merged64(w0: dict, adapter: dict, scaling: float) -> dict[str, torch.Tensor]:
    """W = W0 + s * B @ A in float64 for every adapted base, W0 elsewhere."""
    out = {n: t.double() for n, t in w0.items()}
    for name in adapter:
        if name.endswith(".lora_A"):
            base = name[: -len(".lora_A")]
            out[base] = out[base] + scaling * adapter[base + ".lora_B"].double() @ adapter[name].double()
    return out


@functools.lru_cache(maxsize=2)
def model64(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


def reference(model_dir, weights: dict, ids: list[int], n_prompt: int, temp: float = 1.0) -> list[float]:
    m = model64(str(model_dir))
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(weights[n])
        logits = m(torch.tensor([ids])).logits[0]
    lp = torch.log_softmax(logits / temp, dim=-1)
    return [lp[t - 1, ids[t]].item() for t in range(n_prompt, len(ids))]


def chat(url: str, **kw) -> dict:
    body = {"model": model_of(url), "messages": MSG, "max_tokens": 8, "logprobs": True, "ignore_eos": True,
            "temperature": 1.0, "seed": 7, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def max_error(model_dir, weights: dict, choice: dict) -> float:
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    ref = reference(model_dir, weights, ids, len(choice["prompt_token_ids"]))
    got = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert len(got) == len(ref) > 0
    return max(abs(a - b) for a, b in zip(got, ref))


def body_of(tensors: dict, version: int, rank: int | None, scaling: float = 1.0, **kw) -> dict:
    body = {"version": version, "params": [{"name": n, "shape": list(t.shape), "dtype": NAMES[t.dtype]}
                                           for n, t in tensors.items()], **kw}
    if rank is not None:
        body["adapter"] = {"rank": rank, "scaling": scaling}
    return body


def push_broadcast(sync: WeightSyncClient, url: str, tensors: dict, version: int, rank: int, scaling: float,
                   mode: str = "keep", bucket_bytes: int = 0) -> httpx.Response:
    """An adapter update over the process group, as a trainer sends it: announce, then broadcast each bucket."""
    body = body_of(tensors, version, rank, scaling, mode=mode, bucket_bytes=bucket_bytes)
    infos = [ParamInfo(**p) for p in body["params"]]
    ts = list(tensors.values())
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, url + "/request_weight_update", json=body, timeout=120)
        for bucket in bucket_layout(infos, bucket_bytes):
            size = packed_bytes(infos, bucket)
            buf = ts[bucket[0][0]].contiguous()
            if size:
                buf = torch.zeros(size, dtype=torch.uint8)
                for i, off in bucket:
                    t = ts[i]
                    buf[off: off + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
            sync.group.broadcast([buf], opts).wait()
        return answer.result()


def push_file(url: str, tmp_path, tensors: dict, version: int, rank: int | None, scaling: float = 1.0,
              mode: str = "keep") -> httpx.Response:
    path = tmp_path / f"update-v{version}.safetensors"
    save_file({n: t.clone() for n, t in tensors.items()}, str(path))
    body = {"version": version, "path": str(path), "mode": mode}
    if rank is not None:
        body["adapter"] = {"rank": rank, "scaling": scaling}
    return httpx.post(url + "/request_weight_update", json=body, timeout=120)


def version_of(url: str) -> int:
    return httpx.get(url + "/health").json()["version"]


# ---- fixtures -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_model(tiny_model_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def sync(server):
    c = WeightSyncClient([server.url], timeout_s=60)
    c.init_process_group()
    yield c
    c.close()


# ---- tests ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20])
def test_adapter_broadcast_serves_w0_plus_scaled_ba(server, sync, tiny_model_dir, bucket_bytes):
    v = 10 if bucket_bytes == 0 else 20
    w0 = base_weights(tiny_model_dir, seed=v)
    sync.push(w0.items(), version=v)
    adapter = make_adapter(w0, [Q0, V1, D0], rank=4, seed=v)
    r = push_broadcast(sync, server.url, adapter, version=v + 1, rank=4, scaling=2.0, bucket_bytes=bucket_bytes)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == v + 1 and r.json()["pause_s"] >= 0  # the pause is reported
    after = chat(server.url)
    assert set(after["token_versions"]) == {v + 1}
    assert max_error(tiny_model_dir, merged64(w0, adapter, 2.0), after) < 1e-3
    assert max_error(tiny_model_dir, merged64(w0, {}, 0.0), after) > 1e-2  # W0 alone no longer explains them


def test_second_adapter_replaces_the_first_and_full_push_drops_it(server, sync, tiny_model_dir, tmp_path):
    w0 = base_weights(tiny_model_dir, seed=30)
    sync.push(w0.items(), version=30)
    first = make_adapter(w0, [Q0, V1, D0], rank=4, seed=1)
    assert push_broadcast(sync, server.url, first, 31, rank=4, scaling=2.0).status_code == 200
    second = make_adapter(w0, [O1, Q0], rank=2, seed=2)  # V1 and D0 go back to W0; Q0 from W0, not from first
    r = push_file(server.url, tmp_path, second, 32, rank=2, scaling=0.5)
    assert r.status_code == 200, r.text
    after = chat(server.url)
    assert set(after["token_versions"]) == {32}
    assert max_error(tiny_model_dir, merged64(w0, second, 0.5), after) < 1e-3
    # a full (partial) push of new base weights: the adapter is dropped, bases it does not list are W0 again
    w1 = base_weights(tiny_model_dir, seed=33)
    partial = {n: t for n, t in w1.items() if "layers.0" in n}
    sync.push(partial.items(), version=33)
    want = {**w0, **partial}
    after = chat(server.url)
    assert set(after["token_versions"]) == {33}
    assert max_error(tiny_model_dir, merged64(want, {}, 0.0), after) < 1e-3
    # and the next adapter merges into the new base weights
    third = make_adapter(want, [Q0, O1], rank=3, seed=3)
    assert push_file(server.url, tmp_path, third, 34, rank=3, scaling=1.5).status_code == 200
    assert max_error(tiny_model_dir, merged64(want, third, 1.5), chat(server.url)) < 1e-3


def malformed(w0: dict) -> dict[str, tuple[dict, int]]:
    good = make_adapter(w0, [Q0, V1], rank=4, seed=5)
    nan = dict(good)
    nan[V1 + ".lora_B"] = good[V1 + ".lora_B"].clone()
    nan[V1 + ".lora_B"][3, 1] = float("nan")
    return {
        "unknown base": ({**good, "model.layers.0.self_attn.qq_proj.weight.lora_A": good[Q0 + ".lora_A"],
                          "model.layers.0.self_attn.qq_proj.weight.lora_B": good[Q0 + ".lora_B"]}, 4),
        "rank mismatch": (good, 3),
        "wrong dtype": ({n: t.to(torch.bfloat16) for n, t in good.items()}, 4),
        "shape mismatch": ({**good, Q0 + ".lora_A": torch.randn(4, 65)}, 4),
        "missing half": ({n: t for n, t in good.items() if n != V1 + ".lora_B"}, 4),
        "not a matrix": ({**good, "model.norm.weight.lora_A": torch.randn(4, 64),
                          "model.norm.weight.lora_B": torch.randn(64, 4)}, 4),
        "nan": (nan, 4),
    }


MESSAGES = {"unknown base": "unknown base weight 'model.layers.0.self_attn.qq_proj.weight'",
            "rank mismatch": "do not have rank 3", "wrong dtype": "dtype bfloat16 != model's float32",
            "shape mismatch": "does not fit base model.layers.0.self_attn.q_proj.weight [64, 64]",
            "missing half": "has no .lora_B", "not a matrix": "not a matrix", "nan": "NaN or Inf"}


@pytest.mark.parametrize("transport", ["broadcast", "file"])
def test_malformed_adapters_are_refused_and_change_nothing(server, sync, tiny_model_dir, tmp_path, transport):
    v = 40 if transport == "broadcast" else 50
    w0 = base_weights(tiny_model_dir, seed=v)
    sync.push(w0.items(), version=v)
    served = make_adapter(w0, [D0], rank=2, seed=9)
    assert push_file(server.url, tmp_path, served, v + 1, rank=2, scaling=1.0).status_code == 200
    before = chat(server.url)
    for case, (tensors, rank) in malformed(w0).items():
        if transport == "file":
            r = push_file(server.url, tmp_path, tensors, v + 2, rank=rank, scaling=1.0)
        elif case == "nan":  # received whole, refused before it is applied; the group stays usable
            r = push_broadcast(sync, server.url, tensors, v + 2, rank=rank, scaling=1.0)
        else:  # refused before anything is received: nothing is broadcast
            body = body_of(tensors, v + 2, rank, 1.0)
            check = httpx.post(server.url + "/check_weight_update", json=body, timeout=30)
            assert check.status_code == 400 and MESSAGES[case] in check.text, (case, check.text)
            r = httpx.post(server.url + "/request_weight_update", json=body, timeout=30)
        assert r.status_code == 400, (case, r.text)
        assert MESSAGES[case] in r.json()["error"]["message"], (case, r.text)
        assert version_of(server.url) == v + 1
    after = chat(server.url)
    # the same request again: with prefix reuse its prompt's KV comes from the first one and only its last prompt
    # token runs again (alone), so the logprobs agree to float32 rounding, not bit for bit
    assert after["token_ids"] == before["token_ids"]
    lp = lambda c: [e["logprob"] for e in c["logprobs"]["content"]]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(lp(after), lp(before))) < 1e-5
    assert max_error(tiny_model_dir, merged64(w0, served, 1.0), after) < 1e-3
    # the group is still in step: a good adapter over it is applied
    good = make_adapter(w0, [Q0], rank=4, seed=11)
    assert push_broadcast(sync, server.url, good, v + 3, rank=4, scaling=1.0).status_code == 200
    assert max_error(tiny_model_dir, merged64(w0, good, 1.0), chat(server.url)) < 1e-3


@pytest.mark.parametrize("mode", ["keep", "interrupt"])
def test_adapter_push_during_long_generation(server, sync, tiny_model_dir, mode):
    """Versions switch once per choice; interrupt re-prefills, so later tokens are a fresh forward of W0 + s*B@A."""
    v = 60 if mode == "keep" else 70
    w0 = base_weights(tiny_model_dir, seed=v)
    sync.push(w0.items(), version=v)
    adapter = make_adapter(w0, [Q0, V1, D0, O1], rank=4, seed=v)
    def push() -> None:
        r = push_broadcast(sync, server.url, adapter, v + 1, rank=4, scaling=2.0, mode=mode)
        assert r.status_code == 200, r.text

    prompt, seen, got, versions = generation_across_update(server.url, MSG, push, v, v + 1)
    switch = versions.index(v + 1)
    assert versions == [v] * switch + [v + 1] * (len(versions) - switch)
    ids, n_prompt = prompt + seen, len(prompt)
    ref_old = reference(tiny_model_dir, merged64(w0, {}, 0.0), ids, n_prompt)
    assert max(abs(a - b) for a, b in zip(got[:switch], ref_old[:switch])) < 1e-3
    ref_new = reference(tiny_model_dir, merged64(w0, adapter, 2.0), ids, n_prompt)
    err_new = max(abs(a - b) for a, b in zip(got[switch:], ref_new[switch:]))
    if mode == "interrupt":
        assert err_new < 1e-3
    else:  # keep: later tokens attend to KV computed by the old weights
        assert err_new > 1e-3


def test_adapter_on_a_tied_model(tied_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from inflight.engine.serve import ServerProcess

    hf = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)
    w0 = {n: p.detach() for n, p in hf.named_parameters()}  # the embedding once: lm_head is its alias
    # every matrix pre-packed, the tied head included: the merged update must rebuild the derived copies
    with ServerProcess(str(tied_model_dir), extra_args=["--max-model-len", "512"],
                       env={"OMP_NUM_THREADS": "1", "INFLIGHT_PACK_MIN_ELEMENTS": "1"}) as srv:
        adapter = make_adapter(w0, [Q0], rank=4, seed=3)
        r = push_file(srv.url, tmp_path, adapter, 1, rank=4, scaling=2.0)
        assert r.status_code == 200, r.text
        assert max_error(tied_model_dir, merged64(w0, adapter, 2.0), chat(srv.url)) < 1e-3
        vocab = w0["model.embed_tokens.weight"].shape[0]
        head = {"lm_head.weight.lora_A": torch.randn(4, 64), "lm_head.weight.lora_B": torch.randn(vocab, 4)}
        r = push_file(srv.url, tmp_path, head, 2, rank=4, scaling=1.0)
        assert r.status_code == 400 and "tied to 'model.embed_tokens.weight'" in r.text, r.text
        assert version_of(srv.url) == 1


def test_adapter_of_every_linear_over_shared_memory(server, sync, tiny_model_dir, tmp_path):
    from inflight.transport.layout import shm_layout
    from inflight.transport.shm import ShmWriter, announcement_digest

    w0 = base_weights(tiny_model_dir, seed=80)
    sync.push(w0.items(), version=80)
    linears = [n for n in w0 if "_proj." in n]  # every linear weight: more tensors than the model has parameters
    adapter = make_adapter(w0, linears, rank=8, seed=80, scale=0.15)
    assert len(adapter) > len(w0)
    body = body_of(adapter, 81, 8, 0.25)
    infos = [ParamInfo(**p) for p in body["params"]]
    offsets, data_bytes = shm_layout(infos)
    writer = ShmWriter(str(tmp_path))
    try:
        body["shm"] = writer.write(list(adapter.items()), [p.dtype for p in infos], offsets, data_bytes, 81,
                                   announcement_digest(infos))
        r = httpx.post(server.url + "/request_weight_update", json=body, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        writer.discard()
    after = chat(server.url)
    assert set(after["token_versions"]) == {81}
    assert max_error(tiny_model_dir, merged64(w0, adapter, 0.25), after) < 1e-3


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8"])
def test_adapter_rebuilds_the_derived_generator_weights(tiny_model_dir, tmp_path, monkeypatch, precision):
    """The forward computes with weights derived from the master (oneDNN-packed float32, bf16, int8): an adapter
    update must reach them, as a full update does. The fused q|k|v matrix the forward uses = merged q, k, v."""
    import asyncio

    from inflight.engine.core import InferenceEngine
    from inflight.engine.model import precision as prec
    from inflight.engine.weights.receiver import WeightReceiver
    from inflight.transport.schemas import WeightUpdateRequest

    monkeypatch.setattr(prec, "PACK_MIN_ELEMENTS", 1)  # the tiny matrices would not be packed otherwise
    eng = InferenceEngine(str(tiny_model_dir), max_batch=2, max_model_len=64, generator_precision=precision)
    w0 = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    adapter = make_adapter(w0, [Q0, "model.layers.0.self_attn.k_proj.weight"], rank=4, seed=1)
    path = tmp_path / "a.safetensors"
    save_file(adapter, str(path))
    receiver = WeightReceiver(eng)
    builds = eng.runner.weight_builds
    eng.start()
    try:
        answer = asyncio.run(receiver.update(WeightUpdateRequest(
            version=1, path=str(path), adapter={"rank": 4, "scaling": 1.5})))
    finally:
        eng.stop()
    assert answer["version"] == 1 and eng.version == 1 and eng.runner.weight_builds == builds + 1
    want = merged64(w0, adapter, 1.5)
    qkv = torch.cat([want[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv"]).float()
    L = eng.runner.gen.layers[0]
    eye = torch.eye(qkv.shape[1], dtype=eng.runner.dtype)
    got = prec.linear(eye, L["w_qkv"], L["b_qkv"]).float().T  # = the matrix the forward multiplies with
    tol = {"float32": 1e-5, "bfloat16": 2e-2, "int8": 2e-2}[precision]
    assert (got - qkv).abs().max() < tol * max(1.0, qkv.abs().max().item())
    old = torch.cat([w0[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv"])
    assert (got - old).abs().max() > 5 * tol  # not the weights before the update


def _save_peft_adapter(model_dir, out, use_rslora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0, use_rslora=use_rslora,
                     target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(hf, cfg)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # lora_B starts at zero: give it values, or the adapter would change nothing
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(out)
    return peft_model.eval()


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_folder_is_read_with_peft_names_and_scaling(tiny_model_dir, tmp_path, use_rslora):
    """read_peft_adapter against PEFT itself: W0 + s * B @ A from the saved folder, in float64, gives PEFT's own
    (unmerged) forward."""
    from inflight.modelkit.peft_adapter import read_peft_adapter

    peft_model = _save_peft_adapter(tiny_model_dir, tmp_path / "adapter", use_rslora)
    adapter = read_peft_adapter(str(tmp_path / "adapter"))
    assert adapter.rank == 4 and adapter.scaling == pytest.approx(12 / 2 if use_rslora else 12 / 4)
    assert len(adapter.tensors) == 2 * 3 * 2  # (A, B) x 3 modules x 2 layers
    assert adapter.tensors[Q0 + ".lora_A"].shape == (4, 64) and adapter.tensors[Q0 + ".lora_B"].shape == (64, 4)
    from transformers import AutoModelForCausalLM

    saved = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32).named_parameters()}
    ids = list(range(5, 25))
    ref = reference(tiny_model_dir, merged64(saved, adapter.tensors, adapter.scaling), ids, 1)
    with torch.no_grad():
        lp = torch.log_softmax(peft_model(torch.tensor([ids])).logits[0].double(), -1)
    peft_lps = [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(ref, peft_lps)) < 1e-4


def test_serve_starts_from_a_saved_peft_adapter(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from inflight.engine.serve import ServerProcess
    from inflight.modelkit.peft_adapter import read_peft_adapter

    _save_peft_adapter(tiny_model_dir, tmp_path / "adapter", use_rslora=False)
    adapter = read_peft_adapter(str(tmp_path / "adapter"))
    w0 = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32).named_parameters()}
    with ServerProcess(str(tiny_model_dir), extra_args=["--max-model-len", "512", "--adapter",
                                                        str(tmp_path / "adapter")],
                       env={"OMP_NUM_THREADS": "1"}) as srv:
        first = chat(srv.url)
        assert set(first["token_versions"]) == {0}
        assert max_error(tiny_model_dir, merged64(w0, adapter.tensors, adapter.scaling), first) < 1e-3
        # an adapter update replaces the one it started with: the bases it does not list are the saved W0 again
        new = make_adapter(w0, [O1], rank=2, seed=6)
        assert push_file(srv.url, tmp_path, new, 1, rank=2, scaling=1.0).status_code == 200
        assert max_error(tiny_model_dir, merged64(w0, new, 1.0), chat(srv.url)) < 1e-3
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        cfg = json.load(f)
    cfg["use_dora"] = True
    with open(tmp_path / "adapter" / "adapter_config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(RuntimeError, match="use_dora not supported"):
        ServerProcess(str(tiny_model_dir), extra_args=["--adapter", str(tmp_path / "adapter")],
                      startup_timeout_s=60)


def test_adapter_on_the_generic_hf_path_is_copied_in(gpt2_dir, tmp_path):
    """Off the fast llama path there is no fused storage to swap: the merged weights are copied in (and reverted)."""
    import asyncio

    from inflight.engine.core import InferenceEngine
    from inflight.engine.weights.receiver import WeightReceiver
    from inflight.transport.schemas import WeightUpdateRequest

    eng = InferenceEngine(str(gpt2_dir), max_batch=2, max_model_len=64)
    assert not eng.fast_path
    w0 = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    attn, mlp = "transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"
    first, second = make_adapter(w0, [attn, mlp], rank=2, seed=1), make_adapter(w0, [mlp], rank=2, seed=2)
    receiver = WeightReceiver(eng)
    eng.start()
    try:
        for v, ad in ((1, first), (2, second)):
            save_file(ad, str(tmp_path / f"{v}.safetensors"))
            asyncio.run(receiver.update(WeightUpdateRequest(version=v, path=str(tmp_path / f"{v}.safetensors"),
                                                            adapter={"rank": 2, "scaling": 0.5})))
    finally:
        eng.stop()
    want = merged64(w0, second, 0.5)
    for n, p in eng.model.named_parameters():
        assert torch.allclose(p.double(), want[n], atol=1e-6), n  # attn is W0 again
    assert eng.version == 2


def test_serve_adapter_is_refused_with_another_engine(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "inflight.cli", "serve", "--model", str(tmp_path), "--engine", "vllm",
                        "--adapter", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--adapter is for the built-in engine" in r.stderr, r.stderr
