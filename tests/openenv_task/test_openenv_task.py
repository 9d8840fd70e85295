"""task.name=openenv against a real OpenEnv server (the guessing game of guess_env.py, its own process, /ws sessions)
and a real `inflight serve` (tiny random model, ChatML template): one episode is one Sample whose model tokens are
exactly those sampled, turn by turn, with the environment's feedback turns rendered once and masked; the rewards
are those the environment's observations carried (recomputed here from the replies); bad settings fail at start."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from inflight.actor import ActorConfig, ServerPool
from inflight.actor.episode import EnvFailed, EpisodeConfig, run_episode
from inflight.actor.turns import TurnRenderer
from inflight.tasks import TaskConfig, get_task
from inflight.tasks.openenv_env import OpenEnvError
from inflight.trainer.packing import collate, count_loss_tokens
from tests.actor.helpers import Recording, assert_model_logprobs_float64
from tests.openenv_task.conftest import AGENT, SKIP_REASON, guess_server
from tests.openenv_task.guess_agent import parse

pytest.importorskip("openenv.core.env_server", reason=SKIP_REASON)
from tests.openenv_task.guess_env import MAX_GUESSES, reward_of, secret_of  # noqa: E402 - after the skip
from tests.reliability.pipeline_helpers import free_port
from tests.servers import serve_model

pytestmark = pytest.mark.slow  # starts an inference server and an OpenEnv server


@pytest.fixture(scope="module")
def env_url():
    with guess_server(max_sessions=2) as url:
        yield url


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_model(tiny_model_dir, "--threads", "1") as s:
        yield s


def openenv_cfg(url: str, **args) -> TaskConfig:
    env_args = {"renderer": f"{AGENT}:render", "action_parser": f"{AGENT}:parse", "max_sessions": 2, **args}
    return TaskConfig(name="openenv", env=url, env_args=env_args, eval_size=4, max_turns=5)


def play(task, server_url: str, model_dir, max_new_tokens: int = 12) -> list:
    """Every held-out episode at once (more than the server's sessions): [(sample, completions, episode)]."""
    render = TurnRenderer(AutoTokenizer.from_pretrained(model_dir))

    async def main():
        pool = ServerPool([server_url], retries=1, request_timeout_s=60)
        try:
            async def one(ts):
                client = Recording(pool, ActorConfig(group_size=1, max_new_tokens=max_new_tokens, temperature=1.0))
                s = await run_episode(ts, task.make_env(ts), client, render, EpisodeConfig(max_turns=5, max_tokens=400))
                return ts, client.seen, s
            return await asyncio.gather(*(one(ts) for ts in task.eval_samples()))
        finally:
            await pool.aclose()

    return asyncio.run(main())


def expected_game(replies: list[str], seed: int) -> tuple[list[float], list[str]]:
    """What the game answers to these replies: each step's reward, and the feedback turns before the last reply."""
    secret, rewards, feedback = secret_of(seed), [], []
    for k, reply in enumerate(replies):
        g = parse(reply)["guess"]
        rewards.append(reward_of(g, secret))
        if g == secret or k + 1 == MAX_GUESSES:
            break
        word = "That is not a number." if g < 0 else "Too low." if g < secret else "Too high."
        feedback.append(f"{word} Guess again. ({MAX_GUESSES - k - 1} left)")
    return rewards, feedback


def test_episodes_exact_tokens_masked_feedback_and_the_env_rewards(env_url, server, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = get_task(openenv_cfg(env_url))
    r = TurnRenderer(tok)
    turns = []
    for ts, seen, s in play(task, server.url, tiny_model_dir):
        assert s.label in ("correct", "wrong"), s.meta.get("env_error")  # the game ended every episode
        rewards, feedback = expected_game([c.text for c in seen], ts.meta["seed"])
        assert len(seen) == len(rewards) == s.meta["turns"] == s.meta["env_steps"] and len(feedback) == len(seen) - 1
        assert s.meta["turn_rewards"] == pytest.approx(rewards, abs=0) and s.reward == pytest.approx(sum(rewards))
        turns.append(len(seen))
        # the first prompt is the reset observation rendered by the renderer, through the chat template
        question = [{"role": "user", "content": "I am thinking of a number between 1 and 50. Guess it: reply with "
                                                "one number."}]
        assert s.prompt_ids == seen[0].prompt_ids == list(tok.apply_chat_template(
            question, add_generation_prompt=True, tokenize=True, return_dict=False))
        ids, mask, lps = [], [], []
        for k, c in enumerate(seen):  # model turn | feedback delta | model turn ...
            assert c.prompt_ids == s.prompt_ids + ids  # each turn continued from exactly the episode so far
            ids, mask, lps = ids + c.token_ids, mask + [1] * len(c.token_ids), lps + c.logprobs
            if k < len(feedback):
                d = r.delta(c.token_ids, [{"role": "user", "content": feedback[k]}])
                ids, mask, lps = ids + d, mask + [0] * len(d), lps + [0.0] * len(d)
        assert s.completion_ids == ids and s.loss_mask == mask and s.logprobs == pytest.approx(lps)
        # the trainer's batch trains exactly the sampled tokens with their behaviour logprobs
        b = collate([s], [1.0], 1, count_loss_tokens([s]))
        trained = b.loss_mask > 0
        assert b.input_ids[trained].tolist() == [t for c in seen for t in c.token_ids]
        assert b.behaviour_logprobs[trained].tolist() == pytest.approx([x for c in seen for x in c.logprobs])
    assert max(turns) > 1  # episodes of several steps
    assert_model_logprobs_float64(tiny_model_dir, s)


def test_final_reward_and_a_renderer_without_context(env_url, server, tiny_model_dir):
    """reward: final counts the last observation's reward only; a renderer may take the observation alone."""
    task = get_task(openenv_cfg(env_url, reward="final", renderer=f"{AGENT}:render_observation_only"))
    for ts, seen, s in play(task, server.url, tiny_model_dir):
        rewards, _ = expected_game([c.text for c in seen], ts.meta["seed"])
        assert s.meta["turns"] == len(rewards) and s.meta["turn_rewards"] == [rewards[-1]]
        assert s.reward == rewards[-1]


def test_more_episodes_than_sessions_wait_for_one_unlimited_ones_are_refused(env_url, server, tiny_model_dir):
    """The server allows 2 sessions; 4 episodes at once: with max_sessions=2 all play (above), with no limit the
    server refuses some, and the error names the setting."""
    task = get_task(openenv_cfg(env_url, max_sessions=0))
    with pytest.raises(EnvFailed, match="max_sessions"):
        play(task, server.url, tiny_model_dir)


@pytest.mark.parametrize("change, message", [
    ({"renderer": "tests.openenv_task.no_such_module:render"}, "renderer=.*cannot import tests.openenv_task.no_such_module"),
    ({"renderer": f"{AGENT}:no_such_function"}, "has no function 'no_such_function'"),
    ({"action_parser": "parse"}, "action_parser.*'package.module:function'"),
    ({"rendrer": f"{AGENT}:render"}, r"unknown key\(s\) \['rendrer'\]"),
    ({"reward": "mean"}, "reward='mean': choose one of"),
    ({"reset_args": {"seed": 3}}, "'seed' is set per episode"),
])
def test_bad_env_args_fail_at_start(env_url, change, message):
    with pytest.raises(OpenEnvError, match=message):
        get_task(openenv_cfg(env_url, **change))


def test_no_server_or_no_url_fails_at_start():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(OpenEnvError, match=f"no OpenEnv server answers at {url}"):
        get_task(openenv_cfg(url))
    with pytest.raises(OpenEnvError, match="set task.env to the OpenEnv server's URL"):
        get_task(openenv_cfg(""))
    with pytest.raises(OpenEnvError, match="needs task.env_args.action_parser"):
        get_task(TaskConfig(name="openenv", env=url, env_args={"renderer": f"{AGENT}:render"}))
