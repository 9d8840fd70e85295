"""The stock-vLLM LoRA client (trainer/weight_sync/vllm_lora.py) without a server: the folder it writes is an adapter
PEFT itself loads, whose forward equals a float64 forward of W0 + s * B @ A; malformed adapters are refused before
anything is written; the actor asks for the adapter of its version and stamps that version on every token.
Against a real stock vLLM: tests/vllm/test_stock_lora.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inflight.trainer.weight_sync.vllm_lora import AdapterRejected, VLLMLoraSync, checkpoint_shapes
from tests.test_lora_push import make_adapter, merged64

Q0, V1, D0 = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
              "model.layers.0.mlp.down_proj.weight")


@pytest.fixture()
def client(tiny_model_dir, tmp_path):
    c = VLLMLoraSync(["http://127.0.0.1:1"], tmp_path / "adapters", base_shapes=checkpoint_shapes(tiny_model_dir),
                     max_rank=8, keep=2)
    yield c
    c.close()


def w0_of(model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {n: p.detach().clone() for n, p in
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()}


def test_saved_folder_is_the_adapter_for_peft(tiny_model_dir, tmp_path, client):
    """PeftModel.from_pretrained reads the folder (r, lora_alpha = s * r, PEFT's tensor names) and its logits are
    those of the merged float64 weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    w0 = w0_of(tiny_model_dir)
    adapter = make_adapter(w0, [Q0, V1, D0], rank=4, seed=3)
    client.check(adapter, 4, 0.75)
    out = tmp_path / "one"
    client.save(adapter, 4, 0.75, out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64),
                                     str(out)).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(merged64(w0, adapter, 0.75)[n])
        ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
        got, want = peft(ids).logits, ref(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)(ids).logits
    assert (got - want).abs().max().item() < 1e-9
    assert (plain - want).abs().max().item() > 1e-2  # the adapter does change the output


@pytest.mark.parametrize("case, match", [
    ("nan", r"NaN or Inf in \['model.layers.0.self_attn.q_proj.weight.lora_A'\]"),
    ("rank", "rank 16 > the servers' --max-lora-rank 8"),
    ("unknown", "'model.layers.0.self_attn.qq_proj.weight': not a weight of the base checkpoint"),
    ("half", "has no .lora_B"),
    ("shape", "does not make its shape"),
    ("scaling", "scaling inf is not a finite number"),
])
def test_malformed_adapters_are_refused_before_anything_is_written(tiny_model_dir, client, case, match):
    w0 = w0_of(tiny_model_dir)
    rank, scaling = 4, 1.0
    adapter = make_adapter(w0, [Q0, V1], rank=rank, seed=1)
    if case == "nan":
        adapter[Q0 + ".lora_A"][0, 0] = float("nan")
    elif case == "rank":
        rank, adapter = 16, make_adapter(w0, [Q0], rank=16, seed=1)
    elif case == "unknown":
        adapter = {Q0.replace("q_proj", "qq_proj") + s: t for s, t in
                   (("." + k.rsplit(".", 1)[1], v) for k, v in make_adapter(w0, [Q0], 4, 1).items())}
    elif case == "half":
        del adapter[V1 + ".lora_B"]
    elif case == "shape":
        adapter[V1 + ".lora_B"] = torch.zeros(w0[V1].shape[0] + 1, rank)
        adapter[V1 + ".lora_A"] = torch.zeros(rank, w0[V1].shape[1] + 1)
    elif case == "scaling":
        scaling = float("inf")
    with pytest.raises(AdapterRejected, match=match) as e:
        client.push(adapter.items(), version=1, adapter={"rank": rank, "scaling": scaling})
    assert "(HTTP 400)" in str(e.value)  # the trainer loop does not retry it
    assert not client.folder.exists() and client.pushes == 0  # nothing written, nothing sent (no server here)


def test_push_refuses_full_weights_and_interrupt(client):
    with pytest.raises(Exception, match="pushes LoRA adapters only"):
        client.push([("model.norm.weight", torch.ones(4))], version=1)
    with pytest.raises(ValueError, match="only 'keep'"):
        client.push([], version=1, mode="interrupt", adapter={"rank": 1, "scaling": 1.0})


def test_the_actor_asks_for_its_versions_adapter_and_stamps_it():
    """RolloutClient with `served`: a group asks for the adapter of the version it started at (the base model at
    version 0) and every token gets that version; a response served under another name is an error."""
    from inflight.actor.response_parsers import ResponseError, get_adapter
    from inflight.actor.rollout import RolloutClient
    from inflight.actor.run import served_names
    from inflight.config import RunConfig, load_config
    from inflight.config.actor import ActorConfig

    cfg = load_config(RunConfig, overrides=["trainer.protocol=vllm", "trainer.lora.rank=4", "actor.adapter=vllm",
                                            "trainer.lora.served_name=run7"])
    served = served_names(cfg)
    assert served(3) == "run7-v3" and served(0) is None
    assert served_names(load_config(RunConfig, overrides=["trainer.lora.rank=4"])) is None  # inflight's servers

    class Pool:  # answers as vLLM does: "model" is the name the request was served under
        asked: list[str] = []

        async def chat(self, payload):
            Pool.asked.append(payload["model"])
            return get_adapter("vllm")({"model": payload.get("answer_as", payload["model"]), "prompt_token_ids": [1],
                                        "choices": [{"index": 0, "token_ids": [4, 5], "finish_reason": "length",
                                                     "message": {"content": "x"},
                                                     "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]}}]})

    base = RolloutClient(Pool(), ActorConfig(adapter="vllm"), model="base", served=served)
    assert asyncio.run(base.for_group(0, version=3).chat([], n=1))[0].versions == [3, 3]
    assert asyncio.run(base.for_group(0, version=-1).chat([], n=1))[0].versions == [0, 0]  # before any publish
    newest = iter([5, 6])
    evaluating = RolloutClient(Pool(), ActorConfig(adapter="vllm"), model="base", served=served,
                               version=lambda: next(newest))
    assert [asyncio.run(evaluating.chat([], n=1))[0].versions for _ in range(2)] == [[5, 5], [6, 6]]
    assert Pool.asked == ["run7-v3", "base", "run7-v5", "run7-v6"]
    with pytest.raises(ResponseError, match="asked for 'run7-v3', the server answered as 'base'"):
        asyncio.run(base.for_group(0, version=3).chat([], n=1, answer_as="base"))
    plain = RolloutClient(Pool(), ActorConfig(adapter="vllm"), model="base")  # no LoRA: versions as reported
    assert asyncio.run(plain.for_group(0, version=3).chat([], n=1))[0].versions == [-1, -1]
