"""The `openai` client's tool loop against `inflight serve` on SmolLM2-135M-Instruct, served with the shipped
`chatml_tools` template: the model calls get_weather, the client sends the result back as a `tool` message, the
model answers with it. Calls are checked against the reply's own tokens, streamed calls against the whole reply,
and the sampled tokens' logprobs against a float64 forward.

SmolLM2-135M is small: asked cold, it answers in prose instead of calling. The conversation therefore starts with
one earlier question answered by a call (greedy decoding: the same reply every run); with it the model calls
get_weather for the new city and then uses the result."""

from __future__ import annotations

import json
import re

import pytest
import torch

from inflight.engine.api.chat_template import read_chat_template

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # the real model, ~135M parameters on 2 cores

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
START = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Rome"})}}]},
    {"role": "user", "content": "What is the weather in Paris?"},
]
RESULT = "rainy, 12 C"


@pytest.fixture(scope="module")
def server(smollm2_dir):
    from inflight.engine.serve import ServerProcess

    with ServerProcess(str(smollm2_dir), extra_args=["--max-model-len", "1024", "--threads", "1", "--chat-template",
                                                     "chatml_tools"], env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _blocks(raw: str) -> list[dict]:
    return [json.loads(b) for b in re.findall(r"<tool_call>(.*?)</tool_call>", raw, re.S)]


def test_openai_client_tool_loop(client, tokenizer, smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = client.models.list().data[0].id
    messages: list = list(START)
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=48,
                                           logprobs=True)
    ch = first.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    calls = ch.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"})]
    assert len({c.id for c in calls} | {"call_0"}) == 2
    # the call is what the model wrote: its sampled tokens hold that block, nothing else but the end of turn
    extra = ch.model_extra
    ids, prompt_ids = extra["token_ids"], extra["prompt_token_ids"]
    raw = tokenizer.decode(ids)
    assert _blocks(raw) == [{"name": "get_weather", "arguments": {"city": "Paris"}}], raw
    assert raw.endswith("</tool_call><|im_end|>") and ch.message.content is None
    # the prompt is the shipped template's rendering of the messages and tools (HF's own apply_chat_template)
    want = tokenizer.apply_chat_template(START, tools=TOOLS, chat_template=read_chat_template("chatml_tools"),
                                         add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tokenizer.encode(want, add_special_tokens=False)
    # logprobs: one per sampled token, equal to a float64 forward of prompt + sampled tokens
    lps = [e.logprob for e in ch.logprobs.content]
    assert len(lps) == len(ids)
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).double().eval()
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([prompt_ids + ids])).logits[0], dim=-1)
    n = len(prompt_ids)
    assert max(abs(lp - logp[n + i - 1, t].item()) for i, (t, lp) in enumerate(zip(ids, lps))) < 1e-3

    # streamed: the same tokens; the call arrives as delta.tool_calls, with finish_reason tool_calls
    stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=48, stream=True)
    got_ids, deltas, content, finish = [], [], "", None
    for chunk in stream:
        for c in chunk.choices:
            got_ids += (c.model_extra or {}).get("token_ids", [])
            deltas += c.delta.tool_calls or []
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert got_ids == ids and finish == "tool_calls" and content == ""
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"})]

    # the loop: the assistant message goes back as the client got it, then the tool's result
    messages.append(ch.message)
    messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": RESULT})
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=48)
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls, answer
    assert "12" in answer.message.content, answer.message.content  # it read the tool's result
    prompt2 = tokenizer.decode(answer.model_extra["prompt_token_ids"])
    assert prompt2.endswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                            f"<|im_end|>\n<|im_start|>tool\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n")


def test_forced_and_single_calls(client, tokenizer):
    """tool_choice naming the function: the reply starts inside its call (the opening ends the prompt) and ends with
    the call; parallel_tool_calls=false: the reply ends at the first </tool_call>."""
    model = client.models.list().data[0].id
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=START, tools=TOOLS, tool_choice=forced, temperature=0,
                                       max_tokens=48)
    ch = r.choices[0]
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert tokenizer.decode(ch.model_extra["prompt_token_ids"]).endswith("<|im_start|>assistant\n" + opening)
    raw = opening + tokenizer.decode(ch.model_extra["token_ids"])
    assert ch.finish_reason == "tool_calls" and [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
    assert raw.endswith("</tool_call>")  # the reply ended with the call (stopped there)
    args = json.loads(ch.message.tool_calls[0].function.arguments)
    assert _blocks(raw) == [{"name": "get_weather", "arguments": args}]

    r = client.chat.completions.create(model=model, messages=START, tools=TOOLS, parallel_tool_calls=False,
                                       temperature=0, max_tokens=48)
    ch = r.choices[0]
    raw = tokenizer.decode(ch.model_extra["token_ids"])
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    assert raw.endswith("</tool_call>") and "<|im_end|>" not in raw, raw
