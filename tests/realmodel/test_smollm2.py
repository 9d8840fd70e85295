"""A real pretrained model end to end: SmolLM2-135M-Instruct (tied embeddings, 49k BPE vocabulary, ChatML template,
`<|im_end|>` ends a turn), fetched and converted by `inflight get-model` (the session fixture `smollm2_dir`).

The server renders chat prompts exactly as the model's own template does and stops at the end-of-turn token; then
three pipelined `inflight train` steps on it, each pushed into the running server: afterwards the server's logprobs
equal a float64 HF forward of the pushed (final) weights, and its output layer, tied to the embedding, moved with it
(a head left at the old embedding would be far off: that is checked too, so the test can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow  # the real model: ~135M parameters, float32, on 2 cores
REPO = Path(__file__).resolve().parents[2]
MSGS = [{"role": "system", "content": "You are a calculator. Reply with the result as a number."},
        {"role": "user", "content": "What is 3+4? Answer with the number only."}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    from inflight.engine.serve import ServerProcess

    with ServerProcess(str(smollm2_dir), extra_args=["--max-model-len", "256", "--max-batch", "32", "--threads", "1"],
                       env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _chat(url: str, messages=MSGS, **kw) -> dict:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": 24, "logprobs": True, "temperature": 0.0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _hf_logprobs(model, ids: list[int], n_prompt: int) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[t - 1, ids[t]].item() for t in range(n_prompt, len(ids))]


def test_converted_folder_is_a_plain_tied_chat_model(smollm2_dir, tokenizer, monkeypatch):
    from inflight.modelkit import fetch

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] and "quantization_config" not in cfg
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>" and tokenizer.chat_template
    # cached: a second call converts nothing
    monkeypatch.setattr(fetch, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert fetch.get_model("smollm2-135m-instruct", smollm2_dir) == smollm2_dir


def test_chat_prompt_is_the_models_template_and_reply_stops_at_end_of_turn(server, tokenizer):
    ch = _chat(server.url)
    expected = tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ch["prompt_token_ids"] == list(expected)
    assert ch["finish_reason"] == "stop" and ch["token_ids"][-1] == 2  # <|im_end|>, the template's end of turn
    assert "<|im_end|>" not in ch["message"]["content"] and "7" in ch["message"]["content"]
    assert set(ch["token_versions"]) == {0}


def test_three_pipelined_steps_pushed_server_matches_float64_forward_and_tied_head_moved(server, smollm2_dir,
                                                                                          tmp_path):
    from transformers import AutoModelForCausalLM

    from inflight.process import free_port

    args = [sys.executable, "-m", "inflight.cli", "train", str(REPO / "configs" / "cpu-smollm2.yaml"),
            f"model.path={smollm2_dir}", f"pipeline.run_dir={tmp_path}", "name=smol", f"pipeline.server_urls=[{server.url}]",
            f"pipeline.weight_sync_port={free_port()}", "pipeline.max_steps=3", "pipeline.max_minutes=0",
            "pipeline.progress=false", "pipeline.tensorboard=false", "trainer.lr=3e-4", "actor.group_size=4",
            "trainer.lora=null",  # full fine-tuning: the tied embedding and head move together
            "actor.groups_per_step=2", "actor.max_new_tokens=12", "actor.max_lag=1", "task.eval_size=4",
            "actor.eval_every=100", "algo.entropy_coef=0.01"]  # every sample has a gradient, whatever the rewards
    res = subprocess.run(args, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    run = tmp_path / "smol"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "train_step"]
    pushes = [r for r in records if r.get("event") == "weight_push"]
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["step"] for r in pushes] == [1, 2, 3]
    base = [r for r in records if r.get("event") == "eval" and r.get("base")]
    assert len(base) == 1 and base[0]["version_max"] == 0 and base[0]["num_problems"] == 4

    # the server now holds version 3; its logprobs are those of the final checkpoint's weights
    ch = _chat(server.url, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    assert set(ch["token_versions"]) == {3}
    ids, n_prompt = ch["prompt_token_ids"] + ch["token_ids"], len(ch["prompt_token_ids"])
    got = [e["logprob"] for e in ch["logprobs"]["content"]]
    final = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "final", dtype=torch.float64).eval()
    assert final.lm_head.weight is final.model.embed_tokens.weight
    ref = _hf_logprobs(final, ids, n_prompt)
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3, (got, ref)
    # the embedding moved, and the server's head moved with it: the same body with the OLD (tied) head is far off
    start = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float64)
    old = start.model.embed_tokens.weight.detach()
    assert (final.model.embed_tokens.weight - old).abs().max().item() > 1e-4
    final.config.tie_word_embeddings = False
    final.lm_head.weight = torch.nn.Parameter(old.clone())  # a stale head: new body, old output layer
    stale = _hf_logprobs(final, ids, n_prompt)
    assert max(abs(a - b) for a, b in zip(stale, ref)) > 1e-2
