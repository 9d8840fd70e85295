"""The vLLM backend serving a real pretrained model, SmolLM2-135M-Instruct (tied embeddings, 49k BPE vocabulary,
ChatML template): the conformance suite passes against it, prompts are rendered by the model's own chat template,
generation ends at `<|im_end|>`, and its logprobs equal a float64 transformers forward of the same checkpoint."""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from tests.vllm.conftest import VLLM_PYTHON, assert_conformance

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not (VLLM_PYTHON and os.path.exists(VLLM_PYTHON)),
                                 reason="set INFLIGHT_VLLM_PYTHON to the python of the vLLM venv (make test-vllm)")]
MSGS = [{"role": "system", "content": "You are a calculator. Reply with the result as a number."},
        {"role": "user", "content": "What is 3+4? Answer with the number only."}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    from inflight.engine.vllm_backend.process import VLLMServerProcess

    with VLLMServerProcess(str(smollm2_dir), python=VLLM_PYTHON, env={"OMP_NUM_THREADS": "1"},
                           vllm_args=["--dtype", "float32", "--max-model-len", "256", "-O0"]) as proc:
        yield proc


def test_conformance_suite(server):
    assert_conformance(server.url)


def test_chat_template_stop_and_logprobs(server, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": name, "messages": MSGS, "max_tokens": 24, "temperature": 0.0, "logprobs": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["prompt_token_ids"] == tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)
    assert ch["finish_reason"] == "stop" and ch["token_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_end|>" not in ch["message"]["content"] and "7" in ch["message"]["content"]

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float64)
    ids = ch["prompt_token_ids"] + ch["token_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    n = len(ch["prompt_token_ids"])
    ref = [lp[t - 1, ids[t]].item() for t in range(n, len(ids))]
    got = [e["logprob"] for e in ch["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3, (got, ref)
