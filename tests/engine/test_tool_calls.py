"""Tools in chat completions, without the real model: the Hermes parser (whole replies and streams split at every
position), what a chat template can render (probe), and over HTTP on the tiny model (`inflight serve`) the 4xx
answers to bad tool requests and a call cut short in the reply coming back as plain text, never a 500."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from inflight.engine.api import openai_api as oa
from inflight.engine.api.chat_template import (
    ChatTemplateError,
    TemplateAbilities,
    read_chat_template,
    use_chat_template,
)
from inflight.engine.api.http_errors import BadRequest
from inflight.engine.api.routes_openai import ToolUse
from inflight.engine.api.tool_parser import OPEN, HermesStream, parse_hermes
from tests.servers import model_of, serve_model

NAMES = {"get_weather", "add"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SHORT = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}  # 512 characters
REPLIES = [
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\nDone.',
    '  \n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 5}"}',  # open last block, arguments as a string
    "a plain answer, no call",
    "almost <tool_cal but not quite <",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>',  # broken JSON
    '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not one of the tools
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>["add"]</tool_call>',
    "",
]


def test_parse_whole_replies():
    p = parse_hermes(REPLIES[0], NAMES, finished=True)
    assert p.content == "Sure." and [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("get_weather", {"city": "Paris"})]
    p = parse_hermes(REPLIES[1], NAMES, finished=True)
    assert p.content == "Done." and [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    p = parse_hermes(REPLIES[2], NAMES, finished=True)
    assert p.content is None and [(c.name, json.loads(c.arguments)) for c in p.calls] == [("add", {"a": 5})]
    # an open block is a call only when the model ended its turn: cut off (length), it is text
    assert parse_hermes(REPLIES[2], NAMES, finished=False).calls == []
    for bad in REPLIES[3:]:
        p = parse_hermes(bad, NAMES, finished=True)
        assert p.calls == [] and p.content == bad  # plain text, all of it


@pytest.mark.parametrize("reply", REPLIES)
@pytest.mark.parametrize("finished", [True, False])
def test_stream_split_at_every_position_gives_the_whole_parse(reply, finished):
    whole = parse_hermes(reply, NAMES, finished)
    want_content = whole.content if whole.calls else (reply or None)
    for i in range(len(reply) + 1):
        for j in range(i, len(reply) + 1):
            s = HermesStream(NAMES)
            sent = s.feed(reply[:i]) + s.feed(reply[i:j]) + s.feed(reply[j:])
            end = s.finish(finished)
            assert ((sent + (end.content or "")) or None) == want_content, (i, j)
            assert [(c.name, c.arguments) for c in end.calls] == [(c.name, c.arguments) for c in whole.calls]
            if whole.calls:  # nothing of a call is ever sent as content
                assert OPEN not in sent
    s = HermesStream(NAMES)  # one character at a time
    sent = "".join(s.feed(ch) for ch in reply)
    end = s.finish(finished)
    assert ((sent + (end.content or "")) or None) == want_content


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_template_probe(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    own = TemplateAbilities.of(tok)
    assert (own.renders_tools, own.renders_tool_calls, own.parser) == (False, False, "none")
    use_chat_template(tok, "chatml_tools")
    assert tok.chat_template == read_chat_template("chatml_tools")
    shipped = TemplateAbilities.of(tok)
    assert (shipped.renders_tools, shipped.renders_tool_calls, shipped.parser) == (True, True, "hermes")
    assert TemplateAbilities.of(tok, "none").parser == "none"
    with pytest.raises(ChatTemplateError, match="no such file"):
        read_chat_template("no_such_template")
    with pytest.raises(ChatTemplateError, match="tool-call parser"):
        TemplateAbilities.of(tok, "mistral")


def test_shipped_template_renders_tools_calls_and_results(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    use_chat_template(tok, "chatml_tools")
    req = oa.ChatCompletionRequest(model="m", tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rainy, 12 C"}])
    text = tok.apply_chat_template([m.for_template() for m in req.messages], tokenize=False,
                                   tools=[t.function.for_template() for t in req.tools], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n")
    assert json.dumps(WEATHER["function"]) in text  # the signature, as JSON, inside <tools>
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\nrainy, 12 C\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in text
    # without tools it is plain ChatML
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tool_choice_needs_a_parser(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    use_chat_template(tok, "chatml_tools")
    req = oa.ChatCompletionRequest(model="m", tools=[WEATHER], messages=[{"role": "user", "content": "x"}])
    with pytest.raises(BadRequest, match="needs a tool-call parser"):
        ToolUse(req, TemplateAbilities.of(tok, "none"))
    none = oa.ChatCompletionRequest(model="m", tools=[WEATHER], tool_choice="none",
                                    messages=[{"role": "user", "content": "x"}])
    assert ToolUse(none, TemplateAbilities.of(tok, "none")).parse is False  # text as written
    forced = oa.ChatCompletionRequest(model="m", tools=[WEATHER], messages=[{"role": "user", "content": "x"}],
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    use = ToolUse(forced, TemplateAbilities.of(tok))
    assert use.opening == '<tool_call>\n{"name": "get_weather", "arguments": ' and use.stops == ["</tool_call>"]


# ---- over HTTP, on the tiny model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def own_template(tiny_model_dir):
    with serve_model(tiny_model_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def tools_template(tiny_model_dir):
    with serve_model(tiny_model_dir, "--chat-template", "chatml_tools") as proc:
        yield proc


def chat(url: str, **body) -> httpx.Response:
    body = {"model": model_of(url), "messages": [{"role": "user", "content": "weather in paris?"}], **body}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_tools_with_a_template_without_a_tools_section_is_a_400(own_template):
    r = chat(own_template.url, tools=[WEATHER])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "no tools section" in r.json()["error"]["message"] and "chatml_tools" in r.json()["error"]["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    r = chat(own_template.url, messages=[{"role": "user", "content": "x"},
                                         {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert r.status_code == 400 and "tool_calls" in r.json()["error"]["message"]
    # tool results without tool_calls render as any other message (the model's own template has a tool role)
    r = chat(own_template.url, max_tokens=2, messages=[{"role": "user", "content": "x"},
                                                       {"role": "tool", "tool_call_id": "c1", "content": "12"}])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, needle", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
     "not one of the request's tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]},
     "not valid JSON"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}]}]},
     "must be a JSON object"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]},
     "tool_calls are for assistant messages"),
])
def test_bad_tool_requests_are_400s(tools_template, body, needle):
    r = chat(tools_template.url, **body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


def test_a_call_cut_short_in_the_reply_is_plain_text(tools_template, tiny_tok):
    """A forced call follows its grammar (test_structured_outputs.py), but max_tokens may end the reply inside it:
    a call cut short is not a call, and comes back as content (the forced opening and what the model wrote),
    finish_reason "length"."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(tools_template.url, tools=[SHORT], tool_choice=forced, max_tokens=1, temperature=0, logprobs=True)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert "tool_calls" not in ch["message"] and ch["finish_reason"] == "length"
    assert ch["message"]["content"] == opening + "{"  # the arguments' object opened, as the grammar wants
    assert ch["message"]["content"].startswith(opening)
    assert len(ch["token_ids"]) == len(ch["logprobs"]["content"]) >= 1
    # the sampled tokens are the reply after the opening, which is the end of the prompt
    assert ch["message"]["content"] == opening + tiny_tok.decode(ch["token_ids"], skip_special_tokens=True)
    assert ch["prompt_token_ids"][-len(opening):] == tiny_tok.encode(opening, add_special_tokens=False)
    # streamed: the same tokens, the same text as content, no tool_calls
    with httpx.stream("POST", tools_template.url + "/v1/chat/completions", timeout=120, json={
            "model": model_of(tools_template.url), "messages": [{"role": "user", "content": "weather in paris?"}],
            "tools": [SHORT], "tool_choice": forced, "max_tokens": 1, "temperature": 0, "stream": True}) as s:
        chunks = [json.loads(line[6:])["choices"] for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [c[0] for c in chunks if c]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ch["message"]["content"]
    assert [t for d in deltas for t in d.get("token_ids", [])] == ch["token_ids"]
    assert not any("tool_calls" in d["delta"] for d in deltas) and deltas[-1]["finish_reason"] == ch["finish_reason"]


def test_config_keys_reach_inflight_serve():
    from inflight.config.engine import ServerConfig
    from inflight.engine.builtin_backend import options
    from inflight.engine.serve import add_arguments

    argv = options(ServerConfig(chat_template="chatml_tools", tool_call_parser="hermes"), cuda=False)
    assert argv[-4:] == ["--chat-template", "chatml_tools", "--tool-call-parser", "hermes"]
    assert "--chat-template" not in options(ServerConfig(), cuda=False)
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "m", *argv])
    assert (args.chat_template, args.tool_call_parser) == ("chatml_tools", "hermes")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="engines builtin and vllm"):
        ServerConfig(engine="sglang", chat_template="chatml_tools")
    # vLLM's launcher takes both options too: our chat route over vLLM renders and parses
    from inflight.engine.vllm_backend.backend import options as vllm_options
    from inflight.engine.vllm_backend.launcher import add_arguments as vllm_arguments

    argv = vllm_options(ServerConfig(engine="vllm", chat_template="chatml_tools", tool_call_parser="hermes"), False)
    assert argv[-4:] == ["--chat-template", "chatml_tools", "--tool-call-parser", "hermes"]
    p = argparse.ArgumentParser()
    vllm_arguments(p)
    args, rest = p.parse_known_args(["--model", "m", *argv])
    assert (args.chat_template, args.tool_call_parser) == ("chatml_tools", "hermes") and "--chat-template" not in rest


def test_serve_refuses_a_missing_template(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "inflight.cli", "serve", "--model", str(tiny_model_dir), "--port", "1",
                        "--chat-template", str(tmp_path / "nope.jinja")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "no such file" in r.stderr and "chatml_tools" in r.stderr, r.stderr[-2000:]
