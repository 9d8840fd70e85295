"""Conformance of an inference server to docs/inference-contract.md, through the official `openai` client.
Backend-agnostic: only the contract's promises are checked (runs against any --server-url)."""

from __future__ import annotations

import math

import openai
import pytest

MSG = [{"role": "user", "content": "12+34="}]
NO_EOS = {"ignore_eos": True}  # extension: exact lengths regardless of what the model samples


def _check_choice_extensions(choice, prompt_tokens: int, completion_tokens: int | None = None) -> None:
    extra = choice.model_extra or {}
    for key in ("token_ids", "prompt_token_ids", "token_versions"):
        assert key in extra, f"choice lacks the '{key}' extension"
    assert len(extra["prompt_token_ids"]) == prompt_tokens
    assert len(extra["token_versions"]) == len(extra["token_ids"])
    assert all(isinstance(v, int) and v >= 0 for v in extra["token_versions"])
    if completion_tokens is not None:
        assert len(extra["token_ids"]) == completion_tokens


def test_models_lists_the_served_model(client, model_name):
    ids = [m.id for m in client.models.list().data]
    assert model_name in ids


def test_chat_completion_shape(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=6, temperature=1.0, seed=3,
                                       extra_body=NO_EOS)
    assert r.object == "chat.completion" and r.model == model_name and len(r.choices) == 1
    ch = r.choices[0]
    assert ch.index == 0 and ch.message.role == "assistant" and isinstance(ch.message.content, str)
    assert ch.finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    _check_choice_extensions(ch, r.usage.prompt_tokens, 6)


def test_completion_text_and_token_prompt(client, model_name):
    r = client.completions.create(model=model_name, prompt="12+34=", max_tokens=4, extra_body=NO_EOS)
    assert r.object == "text_completion" and len(r.choices) == 1 and isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    _check_choice_extensions(r.choices[0], r.usage.prompt_tokens, 4)
    ids = r.choices[0].model_extra["prompt_token_ids"]
    r2 = client.completions.create(model=model_name, prompt=ids, max_tokens=3, extra_body=NO_EOS)
    assert r2.choices[0].model_extra["prompt_token_ids"] == ids and r2.usage.prompt_tokens == len(ids)


def test_seed_reproduces_and_stream_matches(client, model_name):
    kw = dict(model=model_name, messages=MSG, max_tokens=12, temperature=1.0, seed=1234, extra_body=NO_EOS)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert a.choices[0].message.content == b.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert text == a.choices[0].message.content
    assert ids == a.choices[0].model_extra["token_ids"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_n_choices(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, n=3, max_tokens=5, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    prompts = {tuple(c.model_extra["prompt_token_ids"]) for c in r.choices}
    assert len(prompts) == 1
    for c in r.choices:
        _check_choice_extensions(c, r.usage.prompt_tokens, 5)


def test_logprobs_and_top_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=6, logprobs=True, top_logprobs=3,
                                       temperature=1.0, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 == len(r.choices[0].model_extra["token_ids"])
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert tops[0] >= entry.logprob - 1e-5  # nothing is more likely than the most likely token
        assert sum(math.exp(v) for v in tops) <= 1 + 1e-4
    t = client.completions.create(model=model_name, prompt="7*8=", max_tokens=4, logprobs=2, extra_body=NO_EOS)
    lp = t.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and len(lp.tokens) == 4 and len(lp.top_logprobs) == 4
    assert all(len(d) <= 2 for d in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)


def test_stop_string_trims_text(client, model_name):
    kw = dict(model=model_name, messages=MSG, max_tokens=24, temperature=1.0, seed=77, extra_body=NO_EOS)
    full = client.chat.completions.create(**kw).choices[0].message.content
    if len(full) < 6:
        pytest.skip("completion too short to pick a stop string from")
    stop = full[3:5]
    cut = client.chat.completions.create(stop=[stop], **kw).choices[0]
    assert cut.message.content == full[: full.find(stop)]
    assert cut.finish_reason == "stop"


def test_greedy_is_deterministic(client, model_name):
    kw = dict(model=model_name, messages=MSG, max_tokens=8, temperature=0.0, extra_body=NO_EOS)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]


# ---- errors ---------------------------------------------------------------------------------------------------
BAD = openai.BadRequestError, openai.UnprocessableEntityError, openai.NotFoundError


def test_unknown_model_is_rejected(client):
    with pytest.raises(BAD) as e:
        client.chat.completions.create(model="no-such-model", messages=MSG, max_tokens=2)
    assert "no-such-model" in str(e.value)


@pytest.mark.parametrize("kw,word", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 100000}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**7}, "max_tokens"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
])
def test_invalid_sampling_values_are_rejected(client, model_name, kw, word):
    with pytest.raises(BAD) as e:
        client.chat.completions.create(model=model_name, messages=MSG, **kw)
    assert word in str(e.value).lower() or "context" in str(e.value).lower()


def test_prompt_longer_than_context_is_rejected(client, model_name):
    with pytest.raises(BAD) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "1" * 200_000}],
                                       max_tokens=1)
    assert "token" in str(e.value).lower()


def test_malformed_json_is_rejected(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={
        "Content-Type": "application/json"})
    assert r.status_code in (400, 422)
    r = http.post("/v1/chat/completions", json={"model": "x"})  # messages missing
    assert r.status_code in (400, 422) and "messages" in r.text
