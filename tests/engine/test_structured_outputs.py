"""Structured outputs (grammar-constrained decoding, model/grammar.py; the API's fields in api/structured.py) on a
real `inflight serve` of the tiny model whose character vocabulary covers JSON (json_model_dir), with the real
`openai` client where it has the parameter: replies that validate against their JSON schema (jsonschema), forced tool
calls that parse and match their tool's parameters, free requests decoding beside constrained ones exactly as alone,
the logprob of a constrained token against a float64 reference of the masked distribution, and the 400s."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.engine.model.grammar import Grammars, GrammarSpec
from tests.servers import model_of, openai_error, serve_model

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 0, "maximum": 999}},
     "required": ["city", "days"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "unit": {"enum": ["c", "f", "k"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "maxItems": 3}}, "required": ["ok", "unit", "tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "number"}}, "required": ["x", "y"]}},
     "required": ["point"]},
]
PROMPTS = ["weather in paris?", "pick a unit", "where is the point?", "hi"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "properties": {"city": {"type": "string", "maxLength": 9}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def server(json_model_dir):
    with serve_model(json_model_dir, "--max-model-len", "1536", "--chat-template", "chatml_tools") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(json_model_dir):
    return AutoTokenizer.from_pretrained(json_model_dir)


def post(server, route: str, **body) -> httpx.Response:
    body = {"model": model_of(server.url), **body}
    return httpx.post(server.url + route, json=body, timeout=120)


# ---- the engine's masking, without a server -------------------------------------------------------------------


def test_mask_touches_only_the_constrained_rows(tok):
    V = len(tok)
    grammars = Grammars(tok, V, {tok.eos_token_id})
    choice = GrammarSpec("choice", json.dumps(["ab", "cd"]))
    compiled = grammars.compile(choice)
    assert grammars.compile(GrammarSpec("choice", json.dumps(["ab", "cd"]))) is compiled and grammars.compiles == 1
    logits = torch.randn(3, V)
    before = logits.clone()
    grammars.mask_logits(logits, [0, 2], [grammars.matcher(compiled), grammars.matcher(compiled)])
    assert torch.equal(logits[1], before[1])  # the free row, bit for bit
    allowed = sorted(tok.convert_tokens_to_ids(["a", "c"]))
    for r in (0, 2):
        finite = torch.isfinite(logits[r]).nonzero()[:, 0].tolist()
        assert finite == allowed and torch.equal(logits[r, allowed], before[r, allowed])
    # a grammar the vocabulary cannot continue ('é' is not in it) allows only the stop token: the sequence ends
    dead = grammars.matcher(grammars.compile(GrammarSpec("regex", "é+")))
    row = torch.randn(1, V)
    grammars.mask_logits(row, [0], [dead])
    assert torch.isfinite(row[0]).nonzero()[:, 0].tolist() == [tok.eos_token_id]
    with pytest.raises(ValueError, match="invalid JSON schema"):
        grammars.compile(GrammarSpec("json_schema", '{"type": "nonsense"}'))


# ---- the OpenAI surface ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_replies_validate(client, schema):
    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    for i, prompt in enumerate(PROMPTS):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           response_format=fmt, max_tokens=400, seed=i, temperature=1.0)
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), schema)
        assert ch.model_extra["token_constrained"] == [True] * len(ch.model_extra["token_ids"])


def test_json_object_and_vllm_parameters_on_both_routes(client, server):
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "hi"}]
    for seed in range(3):
        r = client.chat.completions.create(model=model, messages=msgs, response_format={"type": "json_object"},
                                           max_tokens=400, seed=seed)
        assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    cases = [({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
             ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"structured_outputs": {"regex": r"[a-c]{3}-\d{2}"}}, lambda t: len(t) == 6 and t[3] == "-"),
             ({"guided_regex": r"(ab|cd)+"}, lambda t: t and set(t[::2]) <= {"a", "c"}),
             ({"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z")'}}, lambda t: t in ("xy", "xz")),
             ({"guided_grammar": 'start: "p" "q"'}, lambda t: t == "pq"),  # Lark, as vLLM takes it
             ({"structured_outputs": {"json": SCHEMAS[0]}}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0])
              or True),
             ({"guided_json": json.dumps(SCHEMAS[2])}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[2])
              or True)]
    for extra, ok in cases:
        for route in ("chat", "text"):
            if route == "chat":
                c = client.chat.completions.create(model=model, messages=msgs, max_tokens=300, seed=5,
                                                   extra_body=extra).choices[0]
                text = c.message.content
            else:
                c = client.completions.create(model=model, prompt="an answer:", max_tokens=300, seed=5,
                                              extra_body=extra).choices[0]
                text = c.text
            assert c.finish_reason == "stop" and ok(text), (extra, route, text)
    r = post(server, "/v1/completions", prompt="x", max_tokens=300, response_format={"type": "json_object"})
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["text"]), dict)


def test_tool_choice_required_and_named_give_calls_that_match(client):
    model = client.models.list().data[0].id
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
    named = {"type": "function", "function": {"name": "add"}}
    for i, prompt in enumerate(PROMPTS):
        for choice in ("required", named):
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               tools=[WEATHER, ADD], tool_choice=choice, max_tokens=300, seed=i,
                                               parallel_tool_calls=False)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
            (call,) = ch.message.tool_calls
            assert call.function.name in schemas and (choice == "required" or call.function.name == "add")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # required with parallel calls allowed: one or more calls, each a valid one
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       tools=[WEATHER, ADD], tool_choice="required", max_tokens=600, seed=3)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) >= 1
    for call in ch.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_constrained_reply_is_the_whole_one(server, tok):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "seed": 9,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMAS[1]}}}
    whole = post(server, "/v1/chat/completions", **body).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": model_of(server.url), "stream": True, **body}) as s:
        chunks = [json.loads(line[6:])["choices"] for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [c[0] for c in chunks if c]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == whole["message"]["content"]
    assert [t for d in deltas for t in d.get("token_ids", [])] == whole["token_ids"]
    assert [f for d in deltas for f in d.get("token_constrained", [])] == [True] * len(whole["token_ids"])
    assert deltas[-1]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(whole["message"]["content"]), SCHEMAS[1])


def test_max_tokens_cuts_a_constrained_reply_with_length(server, tok):
    r = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1,
             response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMAS[0]}})
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 4
    assert ch["message"]["content"] == '{"ci'  # what was produced: the schema's first key begins


def test_free_requests_decode_beside_constrained_ones_as_alone(server):
    """Seeded free requests give the same tokens and logprobs whether constrained requests share their steps or
    not: the mask touches only the constrained rows."""
    free = [{"messages": [{"role": "user", "content": p}], "max_tokens": 40, "seed": 100 + i, "ignore_eos": True,
             "logprobs": True} for i, p in enumerate(PROMPTS)]
    constrained = [{"messages": [{"role": "user", "content": p}], "max_tokens": 200, "seed": i, "n": 2,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": s}}}
                   for i, (p, s) in enumerate(zip(PROMPTS, SCHEMAS, strict=False))]

    def run(bodies: list[dict]) -> list[dict]:
        out: list = [None] * len(bodies)

        def one(i: int) -> None:
            out[i] = post(server, "/v1/chat/completions", **bodies[i]).json()["choices"]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    alone = run(free)
    mixed = run(constrained + free)
    for a, m in zip(alone, mixed[len(constrained):], strict=True):
        assert m[0]["token_ids"] == a[0]["token_ids"] and "token_constrained" not in m[0]
        lp_a = [e["logprob"] for e in a[0]["logprobs"]["content"]]
        lp_m = [e["logprob"] for e in m[0]["logprobs"]["content"]]
        assert np.allclose(lp_a, lp_m, atol=1e-5)
    for choices, schema in zip(mixed[: len(constrained)], SCHEMAS, strict=True):
        for ch in choices:  # n=2: each choice has its own grammar state
            jsonschema.validate(json.loads(ch["message"]["content"]), schema)


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (0.0, 1.0), (1.3, 0.9)])
def test_constrained_logprobs_match_a_float64_masked_reference(server, tok, json_model_dir, temperature, top_p):
    """A constrained token's logprob is log_softmax(masked logits / T) of the distribution it was drawn from (T = 1
    for greedy; with top_p, renormalised over the nucleus of the masked distribution), against a float64 forward
    masked by its own xgrammar matcher (xgrammar's own apply); its raw logprob (`token_raw_logprobs`) is
    log_softmax(logits / T) without the mask."""
    import xgrammar as xgr

    schema = SCHEMAS[0]
    r = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "weather?"}], max_tokens=200,
             seed=4, temperature=temperature, top_p=top_p, logprobs=True,
             response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    ch = r.json()["choices"][0]
    ids, prompt = ch["token_ids"], ch["prompt_token_ids"]
    lps = [e["logprob"] for e in ch["logprobs"]["content"]]
    assert ch["finish_reason"] == "stop" and ids[-1] == tok.eos_token_id and len(lps) == len(ids)
    raws = ch["token_raw_logprobs"]  # the same tokens' logprobs without the mask (nor top-p)
    model = AutoModelForCausalLM.from_pretrained(json_model_dir, dtype=torch.float32).double().eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]  # the row of each sampled token
    V = logits.shape[1]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[tok.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema, sort_keys=True), any_whitespace=False, strict_mode=True))
    bitmask = xgr.allocate_token_bitmask(1, V)
    want, want_raw = [], []
    for row, t in zip(logits, ids, strict=True):
        matcher.fill_next_token_bitmask(bitmask, 0)
        masked = row.float()[None].clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask)
        keep = torch.isfinite(masked[0])
        assert keep[t], "the sampled token is one the grammar allows"
        x = torch.where(keep, row, torch.full_like(row, float("-inf")))  # float64 logits, masked
        want_raw.append(torch.log_softmax(row / (temperature or 1.0), dim=-1)[t].item())
        logp = torch.log_softmax(x / (temperature or 1.0), dim=-1)
        if top_p < 1:  # the nucleus: tokens by probability while the mass before them is under top_p
            p, order = logp.exp().sort(descending=True)
            out = torch.ones_like(p, dtype=torch.bool)
            out[order] = (p.cumsum(0) - p) >= top_p
            out[order[0]] = False
            logp = torch.log_softmax(logp.masked_fill(out, float("-inf")), dim=-1)
        want.append(logp[t].item())
        if temperature == 0:
            assert t == int(x.argmax())
        assert matcher.accept_token(t)
    assert matcher.is_terminated()
    assert np.max(np.abs(np.array(lps) - np.array(want))) < 1e-4
    assert np.max(np.abs(np.array(raws) - np.array(want_raw))) < 1e-4
    assert any(w < -1e-3 for w in want)  # a real distribution somewhere, not only forced tokens
    forced = [i for i, w in enumerate(want) if w == 0.0]  # tokens the grammar forced: logprob 0, raw far below
    assert forced and all(lps[i] == 0.0 and raws[i] < -0.1 for i in forced)


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "nonsense"}}}},
     "response_format", "invalid JSON schema"),
    ({"guided_json": "{not json"}, None, "not JSON"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs", "invalid regex"),
    ({"guided_regex": "a{2"}, "guided_regex", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs", "invalid grammar"),
    ({"guided_grammar": "root ::= \"a"}, "guided_grammar", "invalid grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None, "exactly one of"),
    ({"structured_outputs": {}}, None, "exactly one of"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, None, "whitespace_pattern"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, None, "one structured output constraint"),
    ({"response_format": {"type": "json_schema"}}, None, "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, None, "response_format.type"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format",
     "invalid structural tag"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool_choice", "invalid structural tag"),
])
def test_bad_constraints_are_400s_naming_the_problem(server, body, param, needle):
    for route, extra in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                         ("/v1/completions", {"prompt": "hi"})):
        if "tools" in body and route == "/v1/completions":
            continue
        err = openai_error(post(server, route, max_tokens=5, **extra, **body), 400)
        assert needle in err["message"], err
        if param is not None:
            assert err["param"] == param, err
