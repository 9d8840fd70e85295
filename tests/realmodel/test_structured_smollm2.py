"""Structured outputs on a real pretrained model, as a user gets them: the `openai` client against `inflight serve`
on SmolLM2-135M-Instruct with the shipped `chatml_tools` template. Asked cold (no example call in the conversation),
the model alone writes no call (issue #57: 0 of 4); with `tool_choice` "required" or naming the function the server
constrains the reply, and every prompt gets a call that parses and matches the tool's parameters; `response_format`
json_schema replies validate against their schema (jsonschema)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow  # the real model, ~135M parameters on 2 cores

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}
CITIES = ["Paris", "Rome", "Tokyo", "Lima", "Oslo", "Cairo", "Berlin", "Quito"]
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
                                           "capital": {"type": "boolean"}},
          "required": ["city", "population_millions", "capital"]}


@pytest.fixture(scope="module")
def client(smollm2_dir):
    from inflight.engine.serve import ServerProcess

    with ServerProcess(str(smollm2_dir), extra_args=["--max-model-len", "1024", "--threads", "1", "--chat-template",
                                                     "chatml_tools"], env={"OMP_NUM_THREADS": "1"}) as proc:
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_tool_choice_required_and_named_always_call(client):
    model = client.models.list().data[0].id
    schema = WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for i, city in enumerate(CITIES):
        msgs = [{"role": "user", "content": f"What is the weather in {city}?"}]
        for choice in ("required", named):
            r = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], tool_choice=choice,
                                               temperature=0.7, seed=i, max_tokens=60, logprobs=True)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls", (city, choice, ch)
            calls = ch.message.tool_calls  # required with parallel_tool_calls (the default): one call or more
            assert len(calls) == 1 if choice is named else len(calls) >= 1
            for call in calls:
                assert call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), schema)
            extra = ch.model_extra
            assert extra["token_constrained"] == [True] * len(extra["token_ids"]) == [True] * len(ch.logprobs.content)
            assert all(e.logprob <= 0 for e in ch.logprobs.content)


def test_json_schema_replies_validate(client):
    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "city_facts", "schema": ANSWER, "strict": True}}
    for i, city in enumerate(CITIES):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Give facts about {city} as JSON."}],
            response_format=fmt, temperature=0.7, seed=i, max_tokens=80)
        ch = r.choices[0]
        assert ch.finish_reason == "stop", (city, ch)
        jsonschema.validate(json.loads(ch.message.content), ANSWER)
