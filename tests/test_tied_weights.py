"""Tied weights under the weight-update contract (docs/inference-contract.md, "Tied weights"): the shared tensor
travels once, under the name named_parameters() reports (model.embed_tokens.weight); the alias lm_head.weight is a
400 that names it; an update of the embedding refreshes the output layer, derived copies included (oneDNN-packed
float32, bf16)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from inflight.trainer.weight_sync.inflight import WeightSyncClient
from inflight.transport.layout import tied_aliases

torch.set_num_threads(1)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
MSG = [{"role": "user", "content": "3+4="}]


def _trainer(model_dir, lr: float = 5e-2):
    from inflight.config.trainer import TrainerConfig
    from inflight.trainer.single import SingleDeviceTrainer

    t = SingleDeviceTrainer(str(model_dir), TrainerConfig(lr=lr, threads=1))
    t.init()
    return t


def test_trainer_names_each_tied_tensor_once(tied_model_dir, tiny_model_dir):
    t = _trainer(tied_model_dir)
    assert tied_aliases(t.model) == {HEAD: EMBED}
    names = [n for n, _ in t.named_weights()]
    assert HEAD not in names and EMBED in names and len(names) == len(set(names))
    assert names == [n for n, _ in t.model.named_parameters()]
    assert HEAD in [n for n, _ in _trainer(tiny_model_dir).named_weights()]  # untied: both matrices travel


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_engine_update_of_the_embedding_refreshes_the_derived_head(tied_model_dir, monkeypatch, precision):
    """The output layer the forward computes with is derived (pre-packed for oneDNN in float32, a bf16 copy): an
    update that names only the embedding must rebuild it from the new values."""
    from inflight.engine.core import InferenceEngine
    from inflight.engine.model import precision as prec

    monkeypatch.setattr(prec, "PACK_MIN_ELEMENTS", 1)  # the tiny head would not be packed otherwise
    eng = InferenceEngine(str(tied_model_dir), max_batch=2, max_model_len=64, generator_precision=precision)
    gen = eng.runner.gen
    if precision == "float32" and prec.packing_available():
        assert isinstance(gen.head, prec.PackedLinear)
    assert HEAD not in eng.param_specs() and eng.tied_aliases == {HEAD: EMBED}
    new = torch.randn(eng.param_specs()[EMBED][0], generator=torch.Generator().manual_seed(1))
    eng.start()
    try:
        asyncio.run(eng.run_paused(lambda: eng.load_weights({EMBED: new}, version=1)))
        with pytest.raises(ValueError, match="tied to 'model.embed_tokens.weight'"):
            asyncio.run(eng.run_paused(lambda: eng.load_weights({HEAD: new}, version=2)))
    finally:
        eng.stop()
    gen = eng.runner.gen
    eye = torch.eye(new.shape[1], dtype=gen.head_dtype)
    head = prec.linear(eye, gen.head, gen.head_bias).float()  # = W.T of the weight the forward uses
    tol = 1e-6 if precision == "float32" else 1e-2
    assert torch.allclose(head, new.T.to(gen.head_dtype).float(), atol=tol)
    assert torch.allclose(gen.embed.float(), new.to(gen.embed.dtype).float(), atol=tol)
    assert eng.version == 1


@pytest.fixture(scope="module")
def server(tied_model_dir):
    from inflight.engine.serve import ServerProcess

    # every matrix pre-packed, the tied head included: the push below must refresh it
    with ServerProcess(str(tied_model_dir), extra_args=["--max-model-len", "512"],
                       env={"OMP_NUM_THREADS": "1", "INFLIGHT_PACK_MIN_ELEMENTS": "1"}) as proc:
        yield proc


def _chat(url: str, **kw) -> dict:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": MSG, "max_tokens": 8, "logprobs": True, "ignore_eos": True, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_an_alias_in_an_update_is_a_400_naming_the_canonical_name(server, tied_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)
    before = _chat(server.url, temperature=0.0)
    state = hf.state_dict()  # what a trainer announcing state_dict() sends: the alias too, one name too many
    body = {"version": 9, "params": [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in state.items()]}
    client = WeightSyncClient([server.url], timeout_s=60)
    try:
        client.init_process_group()
        for path in ("/check_weight_update", "/request_weight_update"):
            r = httpx.post(server.url + path, json=body, timeout=30)
            assert r.status_code == 400, r.text  # not 413: the list is checked, and the message names the fix
            msg = r.json()["error"]["message"]
            assert "'lm_head.weight' is tied to 'model.embed_tokens.weight'" in msg and "send it once" in msg
        # the trainer's client sends a shared tensor once, whatever names it is given: the same weights, version 9
        client.push(state.items(), version=9)
    finally:
        client.close()
    after = _chat(server.url, temperature=0.0)
    assert after["token_ids"] == before["token_ids"] and set(after["token_versions"]) == {9}


def test_trainer_step_of_a_tied_model_pushed_server_matches_trainer(server, tied_model_dir):
    """A real optimizer step on the tied model, named_weights() broadcast: the server's logprobs equal the trainer's
    own forward (1e-4), the embedding changed, and the server's (packed) head changed with it."""
    from inflight.algo import make_loss
    from inflight.config.algo import AlgoConfig
    from inflight.contracts import Sample
    from inflight.trainer.packing import pack_samples

    trainer = _trainer(tied_model_dir)
    embed0 = trainer.model.get_input_embeddings().weight.detach().clone()
    before = _chat(server.url, temperature=1.0, seed=3)
    lps = [e["logprob"] for e in before["logprobs"]["content"]]
    sample = Sample(group_id="g0", prompt_ids=before["prompt_token_ids"], completion_ids=before["token_ids"],
                    logprobs=lps, versions=before["token_versions"])
    (batch,) = pack_samples([sample], [1.0], 4096, 1, len(sample.completion_ids))
    trainer.backward(batch, make_loss(AlgoConfig()))
    trainer.optimizer_step()
    moved = (trainer.model.get_input_embeddings().weight - embed0).abs().max().item()
    assert moved > 1e-3 and trainer.model.lm_head.weight is trainer.model.get_input_embeddings().weight
    client = WeightSyncClient([server.url], timeout_s=60)
    try:
        client.init_process_group()
        version = 10 + trainer.version  # after the test before's v9: versions never go back
        stats = client.push(trainer.named_weights(), version=version)
    finally:
        client.close()
    assert stats["num_tensors"] == len(list(trainer.model.named_parameters()))
    after = _chat(server.url, temperature=1.0, seed=3)
    assert set(after["token_versions"]) == {version}
    s2 = Sample(group_id="g1", prompt_ids=after["prompt_token_ids"], completion_ids=after["token_ids"],
                logprobs=[e["logprob"] for e in after["logprobs"]["content"]], versions=after["token_versions"])
    (b2,) = pack_samples([s2], [1.0], 4096, 1, len(s2.completion_ids))
    mine = trainer.forward_logprobs(b2)[b2.loss_mask > 0].tolist()
    assert len(mine) == len(s2.logprobs) > 0
    assert max(abs(a - b) for a, b in zip(mine, s2.logprobs)) < 1e-4, (mine, s2.logprobs)
