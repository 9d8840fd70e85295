"""An environment's tools in a multi-turn episode against a real `inflight serve` (tiny random model): with a chat
template that renders tools (the shipped chatml_tools) they go to the server as the request's `tools` and its
tool turns are rendered by that template; with one that does not (the model's own) they are described in a system
message. Either way the prompt is exactly the template's rendering and the environment reads the text the model
wrote."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from inflight.actor import ActorConfig, ServerPool
from inflight.actor.episode import EpisodeConfig, run_episode
from inflight.actor.rollout import RolloutClient
from inflight.actor.turns import TurnRenderer
from inflight.contracts import StepResult, TaskSample
from inflight.engine.api.chat_template import use_chat_template
from inflight.tasks.tool_calls import tools_system_text

pytestmark = pytest.mark.slow  # starts inference servers

TS = TaskSample(id="t0", messages=[{"role": "user", "content": "12*34?"}], answer="408")
CALC = {"name": "calc", "parameters": {"type": "object"}}  # short: the tiny model's context is 512 characters


class WithTools:
    tools = [{"type": "function", "function": CALC}]

    def __init__(self):
        self.replies: list[str] = []

    def reset(self, ts):
        return ts.messages

    def step(self, reply):
        self.replies.append(reply)
        if len(self.replies) == 1:
            return StepResult([{"role": "tool", "content": "408"}])
        return StepResult(reward=1.0, done=True)


def serve(model_dir, *args):
    from inflight.engine.serve import ServerProcess

    return ServerProcess(str(model_dir), extra_args=["--threads", "1", "--max-model-len", "512", *args])


def episode(url: str, tok, env):
    async def main():
        pool = ServerPool([url], retries=1, request_timeout_s=30)
        try:
            client = RolloutClient(pool, ActorConfig(group_size=1, max_new_tokens=8, temperature=1.0))
            return await run_episode(TS, env, client, TurnRenderer(tok), EpisodeConfig(max_turns=2, max_tokens=200))
        finally:
            await pool.aclose()

    return asyncio.run(main())


def test_tools_go_to_a_template_that_renders_them(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    use_chat_template(tok, "chatml_tools")  # as the actor does with server.chat_template
    env = WithTools()
    with serve(tiny_model_dir, "--chat-template", "chatml_tools") as s:
        sample = episode(s.url, tok, env)
    want = tok.apply_chat_template(TS.messages, tools=[CALC], add_generation_prompt=True, tokenize=False)
    assert "<tools>" in want and sample.prompt_ids == tok.encode(want, add_special_tokens=False)
    first = sample.completion_ids[:sample.loss_mask.index(0)]
    assert env.replies[0] == tok.decode(first, skip_special_tokens=True)  # the text as written (tool_choice none)
    # the tool's turn, rendered by the tools template: a `tool` turn holding <tool_response>
    env_ids = [t for t, m in zip(sample.completion_ids, sample.loss_mask) if m == 0]
    closing = "" if first[-1] == tok.convert_tokens_to_ids("<|im_end|>") else "<|im_end|>"
    text = f"{closing}\n<|im_start|>tool\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert env_ids == tok.encode(text, add_special_tokens=False)


def test_tools_are_described_in_a_system_message_otherwise(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = WithTools()
    with serve(tiny_model_dir) as s:
        sample = episode(s.url, tok, env)
    msgs = [{"role": "system", "content": tools_system_text([CALC])}, *TS.messages]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert sample.prompt_ids == tok.encode(want, add_special_tokens=False)
    assert len(env.replies) == 2 and sample.reward == 1.0
