"""A verifiers environment end to end against a real `inflight serve` (tiny random model, ChatML template): the
environments of tests/tasks/vf_envs/tiny_envs.py (written against the verifiers library) through task.name=verifiers.
One episode is one Sample whose model tokens are exactly those sampled, turn by turn, with the environment's turns
masked; the reward is the environment's rubric, equal to the same reward computed here directly; and a short
`inflight train` run trains on such episodes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from inflight.actor import ActorConfig, ServerPool, evaluate
from inflight.actor.episode import EpisodeConfig, run_episode
from inflight.actor.run import open_actor
from inflight.actor.turns import TurnRenderer
from inflight.config import RunConfig
from inflight.streams import MemoryStream
from inflight.tasks import TaskConfig, get_task
from inflight.trainer.packing import collate, count_loss_tokens
from tests.actor.helpers import Recording, assert_model_logprobs_float64
from tests.pipeline.test_end_to_end import run_train
from tests.reliability.pipeline_helpers import free_base_port, free_port, records
from tests.servers import serve_model

# starts an inference server; a test's verifiers environments leave this process's signal handlers as they were
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("keep_signal_handlers")]

ENVS = str(Path(__file__).resolve().parents[1] / "tasks" / "vf_envs" / "tiny_envs.py")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_model(tiny_model_dir, "--threads", "1") as s:
        yield s


def vf_task(kind: str, **kw) -> TaskConfig:
    return TaskConfig(name="verifiers", env=ENVS, env_args={"kind": kind}, **{"eval_size": 4, **kw})


def test_multi_turn_verifiers_episode_exact_tokens_and_rubric(server, tiny_model_dir):
    """RetryEnv (vf.MultiTurnEnv, max_turns 3) answers every reply with a user turn: three model turns, two
    environment turns rendered once and masked; its rubric (digit_share) equals the value computed here."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = get_task(vf_task("retry"))
    ts = task.eval_samples()[0]

    async def main():
        pool = ServerPool([server.url], retries=1, request_timeout_s=30)
        client = Recording(pool, ActorConfig(group_size=1, max_new_tokens=12, temperature=1.0))
        try:
            return await run_episode(ts, task.make_env(ts), client, TurnRenderer(tok),
                                     EpisodeConfig(max_turns=5)), client.seen
        finally:
            await pool.aclose()

    s, (c1, c2, c3) = asyncio.run(main())
    assert s.meta["turns"] == 3 and s.meta["vf_num_turns"] == 3.0  # the env's max_turns ended it, not ours
    assert s.prompt_ids == c1.prompt_ids == list(tok.apply_chat_template(
        ts.messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    r = TurnRenderer(tok)
    user = [{"role": "user", "content": "Try again."}]
    d1, d2 = r.delta(c1.token_ids, user), r.delta(c2.token_ids, user)
    assert tok.decode(d2).endswith("<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n")
    assert s.completion_ids == c1.token_ids + d1 + c2.token_ids + d2 + c3.token_ids
    assert c2.prompt_ids == s.prompt_ids + c1.token_ids + d1 and c3.prompt_ids == c2.prompt_ids + c2.token_ids + d2
    assert s.loss_mask == [1] * len(c1.token_ids) + [0] * len(d1) + [1] * len(c2.token_ids) + [0] * len(d2) + \
        [1] * len(c3.token_ids)
    # the rubric's reward: the share of digits among the characters of the three replies
    text = c1.text + c2.text + c3.text
    assert s.reward == pytest.approx(sum(ch.isdigit() for ch in text) / len(text), abs=1e-12)
    # the trainer trains exactly the sampled tokens with their behaviour logprobs; a float64 forward agrees
    b = collate([s], [1.0], 1, count_loss_tokens([s]))
    trained = b.loss_mask > 0
    assert b.input_ids[trained].tolist() == c1.token_ids + c2.token_ids + c3.token_ids
    assert b.behaviour_logprobs[trained].tolist() == pytest.approx(c1.logprobs + c2.logprobs + c3.logprobs)
    assert_model_logprobs_float64(tiny_model_dir, s)


def test_tool_env_through_the_actor(server, tiny_model_dir):
    """Config wiring: task.name=verifiers gives episode rollouts and episode evaluation; samples come back scored
    by the ToolEnv's rubric (no reward service is built), reward = boxed_answer + 0.5 * used_tool."""
    from verifiers.utils.data_utils import extract_boxed_answer

    run_cfg = RunConfig(task=vf_task("tool", max_turns=3), actor=ActorConfig(
        group_size=2, groups_per_step=2, max_lag=0, eval_every=0, max_new_tokens=24, temperature=1.0))
    run_cfg.model.path = str(tiny_model_dir)
    stream = MemoryStream(capacity=16, ctx=mp.get_context("spawn"))
    stream.publish_version(0)

    async def main():
        async with open_actor(run_cfg, [server.url], stream) as actor:
            assert actor.rewards is None  # episodes are scored by their environment
            groups = await actor.generate_round(2)
            res = await evaluate(actor.task, actor.pool, actor.cfg, episode=actor.rollout.episode)
            return groups, res, {s.id: s.answer for s in actor.task.eval_samples() + actor.task._train}

    groups, res, answers = asyncio.run(main())
    assert res["num_problems"] == 4 and res["num_failed"] == 0 and "tool_calls_mean" in res
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    for s in (s for g in groups for s in g):
        assert len(s.loss_mask) == len(s.completion_ids) and s.label in ("wrong", "correct", "truncated")
        if s.label != "truncated":
            want = (extract_boxed_answer(s.meta["text"]) == answers[s.task_id]) + 0.5 * (s.meta["tool_calls"] > 0)
            assert s.reward == want and s.meta["vf_boxed_answer"] + 0.5 * s.meta["vf_used_tool"] == want


def test_inflight_train_runs_a_verifiers_environment(tiny_model_dir, tmp_path):
    run = tmp_path / "vf"  # pipeline.run_dir / name
    proc = run_train([
        f"model.path={tiny_model_dir}", "name=vf", f"pipeline.run_dir={tmp_path}", "server.num_servers=1",
        f"server.base_port={free_base_port(1)}", "server.threads=1", f"pipeline.weight_sync_port={free_port()}",
        "trainer.threads=1", "pipeline.progress=false", "pipeline.tensorboard=false", "task.name=verifiers",
        f"task.env={ENVS}", "task.env_args.kind=retry", "task.env_args.max_turns=2", "task.eval_size=4",
        "task.max_turns=2", "actor.group_size=2", "actor.groups_per_step=2", "actor.max_new_tokens=16",
        "actor.max_lag=1", "actor.eval_every=2", "pipeline.max_steps=3",
    ], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["samples"] == 4 for r in steps)
    actor = records(run, "actor")
    assert max(r.get("episode_turns_mean", 0) for r in actor) > 1  # multi-turn episodes reached the trainer
    assert all(0 <= r["episode_vf_digit_share_mean"] <= 1 for r in actor if "episode_vf_digit_share_mean" in r)
    evals = records(run, "eval")
    assert evals[0].get("base") and all(r["num_problems"] == 4 and r["num_failed"] == 0 for r in evals)
    assert sum(1 for r in evals if r.get("final")) == 1  # the final evaluation runs whole episodes too
