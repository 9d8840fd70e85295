"""The vLLM backend serving a real pretrained model, SmolLM2-135M-Instruct (tied embeddings, 49k BPE vocabulary,
ChatML template), with `--chat-template chatml_tools` (ChatML with a tools section, shipped with inflight): the
conformance suite passes against it, prompts are rendered by that template, generation ends at `<|im_end|>`, its
logprobs equal a float64 transformers forward of the same checkpoint, and a tool call is read out of the reply."""

from __future__ import annotations

import json
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
                           inflight_args=["--chat-template", "chatml_tools", "--tool-call-parser", "hermes"],
                           vllm_args=["--dtype", "float32", "--max-model-len", "512", "-O0"]) as proc:
        yield proc


def test_conformance_suite(server):
    assert_conformance(server.url)


def test_chat_template_stop_and_logprobs(server, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inflight.engine.api.chat_template import use_chat_template

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    use_chat_template(tok, "chatml_tools")
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


def test_tool_call_read_out_of_the_reply(server, smollm2_dir):
    """The conversation of tests/realmodel/test_tool_loop.py (one earlier question answered by a call, so that the
    135M model calls again): greedy, the reply is a get_weather call for Paris, and the prompt is the shipped
    template's rendering of the messages and tools."""
    from transformers import AutoTokenizer

    from inflight.engine.api.chat_template import read_chat_template
    from tests.realmodel.test_tool_loop import START, TOOLS

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": name, "messages": START, "tools": TOOLS, "max_tokens": 48, "temperature": 0.0})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    calls = ch["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    want = tok.apply_chat_template(START, tools=TOOLS, chat_template=read_chat_template("chatml_tools"),
                                   add_generation_prompt=True, tokenize=False)
    assert ch["prompt_token_ids"] == tok.encode(want, add_special_tokens=False)
