"""task.name=openenv against a real OpenEnv server (the guessing game of guess_env.py, its own process, /ws sessions)
and a real `inflight serve` (tiny random model, ChatML template): one episode is one Sample whose model tokens are
exactly those sampled, turn by turn, with the environment's feedback turns rendered once and masked; the rewards
are those the environment's observations carried (recomputed here from the replies); bad settings fail at start."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from inflight.actor.episode import EnvFailed
from inflight.tasks import TaskConfig, get_task
from inflight.tasks.openenv_env import OpenEnvError
from tests.actor.helpers import assert_model_logprobs_float64
from tests.openenv_task.conftest import AGENT, SKIP_REASON, guess_server

pytest.importorskip("openenv.core.env_server", reason=SKIP_REASON)
from tests.openenv_task.episodes import check_episode, expected_game, play  # noqa: E402 - after the skip
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


def test_episodes_exact_tokens_masked_feedback_and_the_env_rewards(env_url, server, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = get_task(openenv_cfg(env_url))
    played = play(task, server.url, tiny_model_dir)
    for ts, seen, s in played:
        check_episode(tok, ts, seen, s)
    assert max(len(seen) for _, seen, _ in played) > 1  # episodes of several steps
    assert_model_logprobs_float64(tiny_model_dir, played[0][2])


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
    ({"reset_args": [1]}, "reset_args must be a mapping"),
    ({"max_sessions": -1}, "max_sessions must be an integer >= 0"),
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
