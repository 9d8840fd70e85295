"""Environments written for verifiers 0.4 (tests/tasks/vf04_envs: single-turn, multi-turn, tool) on SmolLM2 through
`inflight serve`: verifiers runs each episode (its harness program, Env.run, MCP tool server, scoring) and inflight
generates every model turn. An episode is one Sample whose model tokens are exactly those sampled, with the
environment's turns masked, and whose reward equals the environment's rubric computed here from the reply texts; and
`inflight train` trains 3 steps on the multi-turn and the tool environment (a single-turn episode is the first turn
of a multi-turn one: the episode test above holds it to the same tokens and reward)."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from inflight.actor import ActorConfig, ServerPool
from inflight.actor.episode import EpisodeConfig, run_episode
from inflight.actor.rollout import RolloutClient
from inflight.actor.turns import TurnRenderer
from inflight.tasks import get_task
from inflight.trainer.packing import collate, count_loss_tokens
from tests.actor.helpers import Recording
from tests.pipeline.test_end_to_end import run_train
from tests.reliability.pipeline_helpers import free_base_port, free_port, records
from tests.servers import serve_model
from tests.verifiers04.helpers import ENVS, KINDS, calls_in, expected_reward, needs_v1, vf04_task

pytestmark = [needs_v1, pytest.mark.slow, pytest.mark.usefixtures("keep_signal_handlers")]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with serve_model(smollm2_dir, "--threads", "1") as s:
        yield s


class FirstReplyCalls(Recording):
    """SmolLM2 calls the calculator in few first replies (~1 in 8 at temperature 0.3): the first turn is drawn 48
    times (seeded) and the first reply holding a call is kept, so the episode goes through a tool turn. Every kept
    token is still one the server sampled."""

    async def chat(self, messages, *, n=1, **kw):
        out = await RolloutClient.chat(self, messages, n=48, seed=0, **kw)
        pick = next((c for c in out if calls_in(c.text)), out[0])
        self.seen.append(pick)
        return [pick]


@pytest.mark.parametrize("kind", list(KINDS))
def test_episode_exact_tokens_and_the_rubrics_reward(kind, server, smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    task = get_task(vf04_task(kind))
    samples = task.eval_samples()[:2 if kind == "tool" else 1]  # tool: one episode with a call, one as it comes

    async def main():
        pool = ServerPool([server.url], retries=1, request_timeout_s=60)
        try:
            out = []
            for i, ts in enumerate(samples):
                if kind == "tool" and i == 0:
                    client = FirstReplyCalls(pool, ActorConfig(group_size=1, max_new_tokens=24, temperature=0.3))
                else:
                    client = Recording(pool, ActorConfig(group_size=1, max_new_tokens=24, temperature=1.0))
                s = await run_episode(ts, task.make_env(ts), client, TurnRenderer(tok),
                                      EpisodeConfig(max_turns=4, env_timeout_s=120))
                out.append((ts, s, client.seen))
            return out
        finally:
            await pool.aclose()

    for i, (ts, s, calls) in enumerate(asyncio.run(main())):
        assert s.label != "error", s.meta.get("env_error")
        assert s.meta["turns"] == len(calls) and (kind != "retry" or len(calls) == 3)  # RetryEnv: 3 model turns
        if kind == "single":
            assert len(calls) == 1
        # exact tokens: each turn continues from every token of the episode so far, the environment's turns
        # (tool results, user turns) rendered once between them and masked out of the loss
        assert s.prompt_ids == calls[0].prompt_ids
        ids, mask, env_turns = [], [], []
        for c, nxt in zip(calls, [*calls[1:], None], strict=True):
            ids += c.token_ids
            mask += [1] * len(c.token_ids)
            if nxt is not None:
                assert nxt.prompt_ids[:len(c.prompt_ids) + len(c.token_ids)] == c.prompt_ids + c.token_ids
                delta = nxt.prompt_ids[len(c.prompt_ids) + len(c.token_ids):]
                assert delta and tok.decode(delta).endswith("<|im_start|>assistant\n")
                env_turns.append(tok.decode(delta))
                ids += delta
                mask += [0] * len(delta)
        assert s.completion_ids == ids and s.loss_mask == mask
        if kind == "tool" and i == 0:  # the reply's call reached verifiers, whose tool message is the next turn
            assert calls_in(calls[0].text) and s.meta["tool_calls"] >= 1, [c.text for c in calls]
            assert env_turns and "<|im_start|>tool\n" in env_turns[0], env_turns
        # the trainer trains exactly the sampled tokens with their behaviour logprobs
        b = collate([s], [1.0], 1, count_loss_tokens([s]))
        trained = b.loss_mask > 0
        assert b.input_ids[trained].tolist() == [t for c in calls for t in c.token_ids]
        assert b.behaviour_logprobs[trained].tolist() == pytest.approx([lp for c in calls for lp in c.logprobs])
        # the reward: the environment's rubric, recomputed here from the replies (a truncated episode scores 0)
        if s.label == "truncated":
            assert s.reward == 0.0
        else:
            assert s.reward == pytest.approx(expected_reward(kind, [c.text for c in calls], ts.answer), abs=1e-12)


@pytest.mark.parametrize("kind", ["retry", "tool"])
def test_inflight_train_3_steps(kind, smollm2_dir, tmp_path):
    run = tmp_path / "vf04"
    proc = run_train([
        f"model.path={smollm2_dir}", "name=vf04", f"pipeline.run_dir={tmp_path}", "server.num_servers=1",
        f"server.base_port={free_base_port(1)}", "server.threads=1", "server.max_model_len=512",
        f"pipeline.weight_sync_port={free_port()}", "trainer.threads=1", "trainer.lr=2e-5",
        "pipeline.progress=false", "pipeline.tensorboard=false", "task.name=verifiers",
        f"task.env={ENVS / KINDS[kind]}", "task.eval_size=4", "task.max_turns=4", "task.env_timeout_s=120",
        "actor.group_size=2", "actor.groups_per_step=1", "actor.max_new_tokens=24", "actor.temperature=1.0",
        "actor.max_lag=1", "actor.eval_every=0", "pipeline.max_steps=3",
    ], timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["samples"] == 2 for r in steps)
    actor = [r for r in records(run, "actor") if "episode_turns_mean" in r]
    assert actor, "no episode reached the actor's records"
    for r in actor:
        if kind == "retry":
            assert r["episode_turns_mean"] == pytest.approx(3.0)
            assert 0 <= r["episode_vf_digit_share_mean"] <= 1
        if kind == "tool":
            assert {"episode_vf_correct_mean", "episode_vf_used_tool_mean"} <= set(r)
    # the rewards trained are the rubric's: over all 6 episodes, the sum of the trained rewards equals the weighted
    # sum of the reward functions' values verifiers reported (the env files' weights; a cut-off episode adds 0 to both)
    done = records(run, "actor_done")[-1]
    assert done["samples"] == steps[-1]["samples_total"] == 6 and done["groups_failed"] == 0
    weights = {"retry": {"digit_share": 1.0}, "tool": {"correct": 1.0, "used_tool": 0.5}}[kind]
    rubric = 6 * sum(w * done.get(f"episode_vf_{k}_mean", 0.0) for k, w in weights.items())
    trained = sum(r["reward_mean"] * r["samples"] for r in steps)
    assert trained == pytest.approx(rubric, abs=1e-9), (trained, rubric, steps, done)
    assert kind != "retry" or trained > 0  # retry: some reply holds a digit, so the relation is not 0 == 0
    assert all(0 <= r["reward_mean"] <= sum(weights.values()) for r in steps)
