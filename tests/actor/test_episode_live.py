"""Multi-turn episodes against a real `inflight serve` (tiny random model, ChatML template): one Sample per
episode whose model tokens are exactly those sampled, turn by turn (no re-tokenisation: the float64 reference
scores every turn's tokens in the whole episode's context), environment tokens masked, an episode across a weight
push carries both versions, and a hanging or crashing tool fails its episode without stalling the others."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest
import torch
from transformers import AutoTokenizer

from inflight.actor import ActorConfig, ServerPool, evaluate
from inflight.actor.episode import EpisodeConfig, episode_rollout, run_episode
from inflight.actor.rollout import RolloutClient
from inflight.actor.run import open_actor
from inflight.actor.turns import TurnRenderer
from inflight.algo.losses import lag_stats
from inflight.config import RunConfig
from inflight.contracts import StepResult, TaskSample
from inflight.streams import MemoryStream
from inflight.tasks import TaskConfig
from inflight.trainer.packing import collate, count_loss_tokens
from tests.actor.helpers import LOGPROB_TOL, Recording, assert_model_logprobs_float64, float64_logprobs, set_version

pytestmark = pytest.mark.slow  # starts an inference server

TS = TaskSample(id="t0", messages=[{"role": "user", "content": "What is 12*34?"}], answer="408")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from inflight.engine.serve import ServerProcess

    with ServerProcess(str(tiny_model_dir), extra_args=["--threads", "1", "--max-model-len", "512"]) as s:
        s.tokenizer_dir = str(tiny_model_dir)
        yield s


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("w") / "norm.safetensors"
    save_file({"model.norm.weight": torch.ones(64)}, str(path))
    return str(path)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Scripted:
    """Three model turns: a tool answer, a user turn, then the outcome reward; `on_step` runs inside step."""

    def __init__(self, on_step=None):
        self.replies, self.on_step = [], on_step

    def reset(self, ts):
        return ts.messages

    def step(self, reply):
        self.replies.append(reply)
        if self.on_step:
            self.on_step(len(self.replies))
        if len(self.replies) == 1:
            return StepResult([{"role": "tool", "content": "408"}], info={"tool_calls": 1})
        if len(self.replies) == 2:
            return StepResult([{"role": "user", "content": "Sure?"}], reward=0.25)
        return StepResult(reward=1.0, done=True)


def cfg(**kw) -> ActorConfig:
    return ActorConfig(**{**dict(group_size=3, max_new_tokens=12, temperature=1.0, retries=2), **kw})


def episode(server, env, ecfg=None, client_cls=RolloutClient, **kw):
    render = TurnRenderer(AutoTokenizer.from_pretrained(server.tokenizer_dir))

    async def main():
        pool = ServerPool([server.url], retries=1, request_timeout_s=30)
        client = client_cls(pool, cfg(**kw))
        try:
            s = await run_episode(TS, env, client, render, ecfg or EpisodeConfig(max_turns=4))
            return s, client
        finally:
            await pool.aclose()

    return asyncio.run(main())


def counters(url: str) -> tuple[float, float]:
    import re

    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    return tuple(float(re.search(rf"^{n} (\S+)$", text, re.M).group(1))  # type: ignore[return-value]
                 for n in ("inflight_prefill_tokens_total", "inflight_prefix_reused_tokens_total"))


def test_episode_tokens_are_exactly_the_sampled_ones(server, tok, tiny_model_dir, weights_file):
    set_version([server.url], weights_file, 0, new_run=True)  # an update: the server retains no KV from earlier tests
    before = counters(server.url)
    s, client = episode(server, Scripted(), client_cls=Recording)
    prefilled, reused = (a - b for a, b in zip(counters(server.url), before))
    c1, c2, c3 = client.seen
    assert s.meta["turns"] == 3 and s.label == "correct" and s.reward == 1.25 and s.meta["turn_rewards"] == [0.25, 1.0]
    assert s.meta["tool_calls"] == 1.0 and s.meta["text"] == c3.text
    want_prompt = tok.apply_chat_template(TS.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert s.prompt_ids == list(want_prompt) == c1.prompt_ids
    # turn by turn: model tokens as sampled, then the env's delta, and each next prompt is the episode so far
    r = TurnRenderer(tok)
    d1 = r.delta(c1.token_ids, [{"role": "tool", "content": "408"}])
    d2 = r.delta(c2.token_ids, [{"role": "user", "content": "Sure?"}])
    assert s.completion_ids == c1.token_ids + d1 + c2.token_ids + d2 + c3.token_ids
    assert c2.prompt_ids == s.prompt_ids + c1.token_ids + d1
    assert c3.prompt_ids == c2.prompt_ids + c2.token_ids + d2
    assert s.loss_mask == [1] * len(c1.token_ids) + [0] * len(d1) + [1] * len(c2.token_ids) + [0] * len(d2) + \
        [1] * len(c3.token_ids)
    assert s.logprobs == c1.logprobs + [0.0] * len(d1) + c2.logprobs + [0.0] * len(d2) + c3.logprobs
    assert tok.decode(d1).endswith("<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")
    assert s.meta["env_tokens"] == len(d1) + len(d2)
    # prefix reuse: a later turn prefills only the previous turn's last sampled token (never run) and the env's delta
    assert prefilled == len(c1.prompt_ids) + (1 + len(d1)) + (1 + len(d2))
    assert reused == len(c2.prompt_ids) - 1 - len(d1) + len(c3.prompt_ids) - 1 - len(d2)
    # every model token's behaviour logprob is the float64 model's, in the context of the whole episode
    assert_model_logprobs_float64(tiny_model_dir, s)
    # ... and the check would catch an engine whose completion positions were one off
    got = [lp for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m]
    off = float64_logprobs(tiny_model_dir, s, position_shift=1)
    assert max(abs(a - b) for a, b in zip(got, off, strict=True)) > LOGPROB_TOL
    # the trainer's batch trains exactly the sampled tokens with their logprobs; env tokens are context only
    b = collate([s], [1.0], 1, count_loss_tokens([s]))
    trained = b.loss_mask > 0
    assert b.input_ids[trained].tolist() == c1.token_ids + c2.token_ids + c3.token_ids
    assert b.behaviour_logprobs[trained].tolist() == pytest.approx(c1.logprobs + c2.logprobs + c3.logprobs)
    assert count_loss_tokens([s]) == int(trained.sum())
    assert lag_stats([s], 0)["lag_tokens"] == int(trained.sum())


def test_episode_across_a_weight_push_carries_both_versions(server, weights_file):
    set_version([server.url], weights_file, 0, new_run=True)
    env = Scripted(on_step=lambda turn: set_version([server.url], weights_file, 1) if turn == 1 else None)
    s, client = episode(server, env, client_cls=Recording)
    c1, c2, c3 = client.seen
    assert set(c1.versions) == {0} and set(c2.versions) == set(c3.versions) == {1}
    assert s.first_version == 0 and s.last_version == 1  # the episode counts from its first token
    assert sorted(set(s.model_versions())) == [0, 1]
    assert set(v for v, m in zip(s.versions, s.loss_mask) if not m) == {-1}
    assert lag_stats([s], 1)["lag_hist"] == {"0": len(c2.versions) + len(c3.versions), "1": len(c1.versions)}
    set_version([server.url], weights_file, 0, new_run=True)


class Hanging:
    def __init__(self, how):
        self.how = how

    def reset(self, ts):
        return ts.messages

    def step(self, reply):
        if self.how == "hang":
            time.sleep(30)
        raise RuntimeError("tool crashed")


class AsyncHanging(Hanging):
    async def step(self, reply):
        await asyncio.sleep(30)


class BadMessages(Hanging):
    def step(self, reply):
        return StepResult([{"role": "tool", "content": None}])


@pytest.mark.parametrize("env", [Hanging("hang"), Hanging("crash"), AsyncHanging("hang"), BadMessages("bad")])
def test_hanging_or_crashing_tool_fails_the_episode_only(server, env):
    t0 = time.monotonic()
    s, _ = episode(server, env, EpisodeConfig(max_turns=4, env_timeout_s=1.0))
    assert time.monotonic() - t0 < 15
    assert s.label == "error" and s.reward == 0.0 and s.meta["turns"] == 1
    assert {"hang": "timed out", "crash": "tool crashed", "bad": "must be"}[env.how] in s.meta["env_error"]
    assert len(s.completion_ids) == sum(s.loss_mask) > 0  # the first turn's tokens are still a valid sample


def test_group_with_one_hanging_episode_is_not_stalled(server, tok):
    envs = iter([Hanging("hang"), Scripted(), Scripted()])
    rollout = episode_rollout(lambda ts: next(envs), TurnRenderer(tok), EpisodeConfig(env_timeout_s=1.0))

    async def main():
        pool = ServerPool([server.url], retries=1)
        try:
            return await rollout(TS, RolloutClient(pool, cfg()), cfg())
        finally:
            await pool.aclose()

    t0 = time.monotonic()
    samples = asyncio.run(main())
    assert time.monotonic() - t0 < 15
    assert [s.label for s in samples] == ["error", "correct", "correct"]


def test_turn_and_token_limits_truncate(server):
    s, _ = episode(server, Scripted(), EpisodeConfig(max_turns=2))
    assert s.meta["turns"] == 2 and s.label == "truncated" and s.reward == 0.0 and s.finish_reason == "length"
    s, _ = episode(server, Scripted(), EpisodeConfig(max_turns=4, max_tokens=20))
    assert s.label == "truncated" and len(s.completion_ids) <= 20
    # the server's context (512) ends an episode that outgrows it, without failing it
    class NoEos(RolloutClient):  # every turn runs to max_new_tokens
        async def chat(self, *a, **kw):
            return await super().chat(*a, ignore_eos=True, **kw)

        async def complete(self, *a, **kw):
            return await super().complete(*a, ignore_eos=True, **kw)

    s, _ = episode(server, Scripted(), EpisodeConfig(max_turns=4, max_tokens=5000), client_cls=NoEos,
                   max_new_tokens=400)
    assert s.label == "truncated" and s.meta["turns"] == 1 and sum(s.loss_mask) == 400


def test_arith_tool_task_through_the_actor(server, tiny_model_dir):
    """Config wiring: task.name arith_tool gives episode rollouts (the tokenizer of model.path renders the tool
    turns); samples come back labelled by the environment, one per episode, with the reward service unused."""
    task = TaskConfig(name="arith_tool", eval_size=4, digits=3, terms=2, operators=["*"])
    run_cfg = RunConfig(task=task, actor=cfg(group_size=2, groups_per_step=2, max_lag=0, eval_every=0))
    run_cfg.model.path = str(tiny_model_dir)
    stream = MemoryStream(capacity=16, ctx=mp.get_context("spawn"))
    stream.publish_version(0)

    class NoScoring:
        async def score(self, items):
            raise AssertionError("episodes are scored by their environment")

    async def main():
        async with open_actor(run_cfg, [server.url], stream, rewards=NoScoring()) as actor:
            groups = await actor.generate_round(2)
            res = await evaluate(actor.task, actor.pool, actor.cfg, rewards=NoScoring(),
                                 episode=actor.rollout.episode)
            return groups, actor.metrics.snapshot(), res

    groups, snap, res = asyncio.run(main())
    assert res["num_problems"] == 4 and res["num_failed"] == 0 and "tool_calls_mean" in res
    assert sum(res["labels"].values()) == 4 and res["version_min"] == res["version_max"] == 0
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    for s in (s for g in groups for s in g):
        assert s.loss_mask is not None and len(s.loss_mask) == len(s.completion_ids) and s.meta["turns"] >= 1
        assert s.label in ("wrong", "truncated", "correct") and s.reward in (0.0, 1.0)
    assert snap["actor/episode_turns_mean"] >= 1
