"""Adapter (LoRA) updates on the vLLM backend: the workers merge W0 + s * B @ A and load it through vLLM's own
load path, so stock vLLM generates with the merged weights. Logprobs against a float64 forward written here."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch

from tests.test_lora_push import body_of, make_adapter, merged64, push_broadcast, push_file

VLLM_PYTHON = os.environ.get("INFLIGHT_VLLM_PYTHON", "")
needs_vllm = pytest.mark.skipif(not (VLLM_PYTHON and os.path.exists(VLLM_PYTHON)),
                                reason="set INFLIGHT_VLLM_PYTHON to the python of the vLLM venv (make test-vllm)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]
MSG = [{"role": "user", "content": "12+34="}]
Q0, V1, D0 = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
              "model.layers.0.mlp.down_proj.weight")
O1 = "model.layers.1.self_attn.o_proj.weight"


def _greedy(url: str, name: str) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": name, "messages": MSG, "max_tokens": 8, "temperature": 0, "logprobs": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _error(model_dir, weights: dict, ch: dict) -> float:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(weights[n])
        ids = ch["prompt_token_ids"] + ch["token_ids"]
        lp = torch.log_softmax(m(torch.tensor([ids])).logits[0], -1)
    n = len(ch["prompt_token_ids"])
    ref = [lp[n - 1 + i, t].item() for i, t in enumerate(ch["token_ids"])]
    got = [c["logprob"] for c in ch["logprobs"]["content"]]
    return max(abs(a - b) for a, b in zip(got, ref))


def test_adapter_updates_merge_in_the_workers(vllm_server, vllm_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    url, name = vllm_server.url, Path(vllm_model_dir).name
    hf = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(100)
    w0 = {n: p.detach() + 0.02 * torch.randn(p.shape, generator=g) for n, p in hf.named_parameters()}
    full = WeightSyncClient([url], transport="file")
    sync = WeightSyncClient([url])
    try:
        full.push(w0.items(), version=100)  # known base weights, whatever earlier tests pushed
        first = make_adapter(w0, [Q0, V1, D0], rank=4, seed=1)
        r = push_file(url, tmp_path, first, 101, rank=4, scaling=2.0)
        assert r.status_code == 200 and r.json()["pause_s"] >= 0, r.text
        ch = _greedy(url, name)
        assert ch["token_versions"] == [101] * 8
        assert _error(vllm_model_dir, merged64(w0, first, 2.0), ch) < 1e-3
        assert _error(vllm_model_dir, merged64(w0, {}, 0.0), ch) > 1e-2

        # over the process group, bucketed: replaces the first whole (V1 and D0 back to W0)
        sync.init_process_group()
        second = make_adapter(w0, [O1, Q0], rank=2, seed=2)
        r = push_broadcast(sync, url, second, 102, rank=2, scaling=0.5, bucket_bytes=1 << 16)
        assert r.status_code == 200, r.text
        ch = _greedy(url, name)
        assert ch["token_versions"] == [102] * 8
        assert _error(vllm_model_dir, merged64(w0, second, 0.5), ch) < 1e-3

        # malformed: refused, nothing changes
        bad_rank = body_of(second, 103, 3, 1.0)
        unknown = body_of({"model.layers.0.self_attn.qq_proj.weight.lora_A": torch.zeros(2, 64),
                           "model.layers.0.self_attn.qq_proj.weight.lora_B": torch.zeros(64, 2)}, 103, 2, 1.0)
        for body in (bad_rank, unknown):
            r = httpx.post(url + "/request_weight_update", json=body, timeout=30)
            assert r.status_code == 400, r.text
        nan = dict(second)
        nan[Q0 + ".lora_A"] = nan[Q0 + ".lora_A"].clone()
        nan[Q0 + ".lora_A"][0, 0] = float("inf")
        r = push_file(url, tmp_path, nan, 103, rank=2, scaling=0.5)
        assert r.status_code == 400 and "NaN or Inf" in r.text, r.text
        assert httpx.get(url + "/health").json()["version"] == 102
        big = {n: torch.full_like(t, 1e3) for n, t in second.items()}  # finite, but W0 + 1e35 * B @ A is not
        r = push_file(url, tmp_path, big, 103, rank=2, scaling=1e35)
        assert r.status_code == 400 and "merged weights" in r.text, r.text
        r = push_broadcast(sync, url, big, 103, rank=2, scaling=1e35)  # merged in the pause: refused there too
        assert r.status_code == 400 and "merged weights" in r.text, r.text
        assert httpx.get(url + "/health").json()["version"] == 102
        ch = _greedy(url, name)
        assert ch["token_versions"] == [102] * 8
        assert _error(vllm_model_dir, merged64(w0, second, 0.5), ch) < 1e-3

        # a full (partial) update drops the adapter
        head = {"lm_head.weight": w0["lm_head.weight"] * -1.5}
        full.push(head.items(), version=104)
        ch = _greedy(url, name)
        assert ch["token_versions"] == [104] * 8
        assert _error(vllm_model_dir, {**w0, **head}, ch) < 1e-3
    finally:
        full.close()
        sync.close()
