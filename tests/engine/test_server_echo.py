"""Prompt logprobs over HTTP (`inflight serve`): `echo` with `logprobs` in OpenAI's legacy completions layout,
vLLM's `prompt_logprobs` (completions and chat), `max_tokens: 0`, `prompt_token_versions`, all compared with a
float64 transformers forward of the weights the server reports, with a retained prefix in the cache and across a
file-transport weight update; bad combinations get a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.servers import model_of, serve_model

torch.set_num_threads(1)
TOL = 1e-4


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_model(tiny_model_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def ref64(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).double().eval()


def log_softmax64(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, json={"model": model_of(url), **body}, timeout=120)


def check_echo_choice(ref, tok, prompt_ids: list[int], ch: dict, k: int) -> None:
    """Legacy layout: one entry per prompt token (the first None), then one per generated token; each position's
    top logprobs are the reference's k best, keyed by their decoded text, in rank order."""
    ids = prompt_ids + ch["token_ids"]
    ref_lp = log_softmax64(ref, ids)
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref_lp[t - 1, ids[t]].item() for t in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)) < TOL
    for t in range(1, len(ids)):
        top, row = lp["top_logprobs"][t], ref_lp[t - 1]
        best = row.topk(k).values.tolist()
        assert len(top) == k and all(abs(a - b) < TOL for a, b in zip(top.values(), best, strict=True)), (t, top, best)
        # each entry is a token with that logprob in the reference (ids within TOL of each other may swap)
        near = (row >= best[-1] - TOL).nonzero().view(-1).tolist()
        for s, v in top.items():
            assert any(tok.decode([i]) == s and abs(row[i].item() - v) < TOL for i in near), (t, s, v, top)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert ch["prompt_token_ids"] == prompt_ids


def test_echo_with_logprobs_equals_float64_forward(server, ref64, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = "5+6=11, 7*8=56, 9-4="
    r = post(server.url, "/v1/completions", prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0,
             ignore_eos=True)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    assert ch["text"].startswith(prompt) and len(ch["token_ids"]) == 4
    assert ch["text"] == prompt + tok.decode(ch["token_ids"], skip_special_tokens=True)
    check_echo_choice(ref64, tok, prompt_ids, ch, 2)
    assert "".join(ch["logprobs"]["tokens"][: len(prompt_ids)]) == prompt
    assert ch["prompt_token_versions"] == [None] + [0] * (len(prompt_ids) - 1)
    assert r.json()["usage"]["completion_tokens"] == 4


def test_max_tokens_zero_scores_the_prompt_alone(server, ref64, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [10, 20, 30, 40, 50, 11, 12, 13]
    r = post(server.url, "/v1/completions", prompt=prompt, echo=True, logprobs=1, max_tokens=0, prompt_logprobs=3,
             n=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 0 and len(body["choices"]) == 2
    ref_lp = log_softmax64(ref64, prompt)
    for ch in body["choices"]:
        assert ch["token_ids"] == [] and ch["finish_reason"] == "length"
        check_echo_choice(ref64, tok, prompt, ch, 1)
        pl = ch["prompt_logprobs"]  # vLLM's layout: None, then {token id: {logprob, rank, decoded_token}}
        assert len(pl) == len(prompt) and pl[0] is None
        for pos in range(1, len(prompt)):
            row = ref_lp[pos - 1]
            own = pl[pos][str(prompt[pos])]
            assert abs(own["logprob"] - row[prompt[pos]].item()) < TOL
            assert own["rank"] == int((row > row[prompt[pos]] + 1e-9).sum()) + 1
            top = sorted(((v["rank"], int(t), v["logprob"]) for t, v in pl[pos].items() if v["rank"] <= 3))
            assert [t for _, t, _ in top] == row.topk(3).indices.tolist()
            assert all(abs(v - row[t].item()) < TOL for _, t, v in top)
            assert set(pl[pos]) <= {str(prompt[pos])} | {str(t) for _, t, _ in top}


def test_chat_prompt_logprobs_and_a_retained_prefix(server, ref64):
    """A chat request's prompt logprobs; then a completions request continuing the first one's sequence (whose KV
    is retained for prefix reuse) scores every position anyway."""
    r = post(server.url, "/v1/chat/completions", messages=[{"role": "user", "content": "12+30=? and more text"}],
             max_tokens=5, prompt_logprobs=0, ignore_eos=True)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    first = ch["prompt_token_ids"]
    ref_lp = log_softmax64(ref64, first)
    got = [next(iter(d.values()))["logprob"] for d in ch["prompt_logprobs"][1:]]
    assert max(abs(a - ref_lp[p - 1, first[p]].item()) for p, a in zip(range(1, len(first)), got)) < TOL
    before = httpx.get(server.url + "/metrics").text
    prompt = first + ch["token_ids"] + [30, 31, 32]
    r = post(server.url, "/v1/completions", prompt=prompt, prompt_logprobs=0, max_tokens=1)
    after = httpx.get(server.url + "/metrics").text
    pl = r.json()["choices"][0]["prompt_logprobs"]
    ref_lp = log_softmax64(ref64, prompt)
    got = [pl[p][str(prompt[p])]["logprob"] for p in range(1, len(prompt))]
    assert max(abs(a - ref_lp[p - 1, prompt[p]].item()) for p, a in zip(range(1, len(prompt)), got)) < TOL
    reused = [float(line.split()[1]) for text in (before, after) for line in text.splitlines()
              if line.startswith("inflight_prefix_reused_tokens_total ")]
    assert reused[0] == reused[1]  # nothing skipped
    r = post(server.url, "/v1/completions", prompt=prompt, max_tokens=1)  # unscored: the prefix is reused
    assert r.status_code == 200


def test_prompt_logprobs_are_temperature_1_whatever_the_sampling(server, ref64):
    """The prompt's entries are raw model logprobs; the generated tokens' follow the sampled distribution."""
    prompt = [10, 20, 30, 40, 50, 11, 12, 13]
    r = post(server.url, "/v1/completions", prompt=prompt, echo=True, logprobs=0, max_tokens=6, temperature=0.5,
             top_k=5, ignore_eos=True, seed=3)
    ch = r.json()["choices"][0]
    ids = prompt + ch["token_ids"]
    with torch.no_grad():
        logits = ref64(torch.tensor([ids])).logits[0].double()
    raw = torch.log_softmax(logits, -1)
    got = ch["logprobs"]["token_logprobs"]
    assert max(abs(got[t] - raw[t - 1, ids[t]].item()) for t in range(1, len(prompt))) < TOL
    sampled = torch.log_softmax(logits / 0.5, -1)  # then restricted to the top 5 and renormalised
    for t in range(len(prompt), len(ids)):
        top = sampled[t - 1].topk(5).values
        want = sampled[t - 1, ids[t]].item() - torch.logsumexp(top, 0).item()
        assert abs(got[t] - want) < TOL


def test_prompt_logprobs_after_a_weight_update_report_the_new_version(server, tiny_model_dir, tmp_path):
    """(Changes the module server's weights: the tests after it do not compare with ref64.)"""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    new = {n: (p.detach() + 0.3 * torch.randn(p.shape, generator=g)).contiguous() for n, p in hf.named_parameters()}
    save_file(new, str(tmp_path / "w.safetensors"))
    r = httpx.post(server.url + "/request_weight_update", timeout=120,
                   json={"version": 3, "mode": "keep", "path": str(tmp_path / "w.safetensors")})
    assert r.status_code == 200, r.text
    hf.load_state_dict(new, strict=False)
    ref = hf.double().eval()
    prompt = [10, 20, 30, 40, 50, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21, 22, 23, 24]
    r = post(server.url, "/v1/completions", prompt=prompt, echo=True, logprobs=0, max_tokens=2, ignore_eos=True)
    ch = r.json()["choices"][0]
    assert ch["prompt_token_versions"] == [None] + [3] * (len(prompt) - 1) and ch["token_versions"] == [3, 3]
    ids = prompt + ch["token_ids"]
    ref_lp = log_softmax64(ref, ids)
    got = ch["logprobs"]["token_logprobs"]
    assert max(abs(got[t] - ref_lp[t - 1, ids[t]].item()) for t in range(1, len(ids))) < TOL


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "12", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "12", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "12", "echo": True, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "12", "prompt_logprobs": 1, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "12", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "12", "max_tokens": -1}, "max_tokens"),
])
def test_bad_combinations_get_400(server, path, body, needle):
    r = post(server.url, path, **body)
    assert r.status_code == 400, (body, r.status_code, r.text)
    assert needle in r.json()["error"]["message"], r.text

