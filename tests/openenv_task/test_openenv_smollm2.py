"""task.name=openenv on a real pretrained model, SmolLM2-135M-Instruct, against the guessing game's OpenEnv server:
its episodes (the model does write guesses) hold exactly the sampled tokens and the game's rewards, and `inflight
train` trains on such episodes for 3 steps through the whole pipeline (actor, trainer, weight pushes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from inflight.process import free_port
from inflight.tasks import TaskConfig, get_task
from tests.openenv_task.conftest import AGENT, REPO, SKIP_REASON, guess_server

pytest.importorskip("openenv.core.env_server", reason=SKIP_REASON)
from tests.openenv_task.episodes import check_episode, play  # noqa: E402 - after the skip
from tests.reliability.pipeline_helpers import records  # noqa: E402

pytestmark = pytest.mark.slow  # the real model: ~135M parameters, float32, on 2 cores


@pytest.fixture(scope="module")
def env_url():
    with guess_server(max_sessions=4) as url:
        yield url


@pytest.fixture(scope="module")
def server(smollm2_dir):
    from inflight.engine.serve import ServerProcess

    with ServerProcess(str(smollm2_dir), extra_args=["--max-model-len", "512", "--max-batch", "32", "--threads", "1"],
                       env={"OMP_NUM_THREADS": "1"}) as proc:
        yield proc


def test_smollm2_episodes_exact_tokens_and_the_games_rewards(env_url, server, smollm2_dir):
    task = get_task(TaskConfig(name="openenv", env=env_url, eval_size=4, max_turns=5, env_args={
        "renderer": f"{AGENT}:render", "action_parser": f"{AGENT}:parse", "max_sessions": 4}))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    played = play(task, server.url, smollm2_dir, max_new_tokens=16)
    for ts, seen, s in played:
        check_episode(tok, ts, seen, s)
    assert max(len(seen) for _, seen, _ in played) > 1  # episodes of several steps
    assert any(r > 0 for _, _, s in played for r in s.meta["turn_rewards"])  # the model guesses numbers


def test_inflight_train_three_steps_on_openenv_episodes(env_url, server, smollm2_dir, tmp_path):
    """Runs last in this module: it pushes new weights into the server."""
    args = [sys.executable, "-m", "inflight.cli", "train", str(REPO / "configs" / "cpu-smollm2.yaml"),
            f"model.path={smollm2_dir}", f"pipeline.run_dir={tmp_path}", "name=oe", f"pipeline.server_urls=[{server.url}]",
            f"pipeline.weight_sync_port={free_port()}", "pipeline.max_steps=3", "pipeline.max_minutes=0",
            "pipeline.progress=false", "pipeline.tensorboard=false", "trainer.lr=3e-4", "actor.group_size=2",
            "actor.groups_per_step=2", "actor.max_new_tokens=12", "actor.max_lag=1", "actor.eval_every=100",
            "algo.entropy_coef=0.01",  # every sample has a gradient, whatever the rewards
            "trainer.lora=null",  # full fine-tuning, whatever the demo's recipe
            "task.name=openenv", f"task.env={env_url}", f"task.env_args.renderer={AGENT}:render",
            f"task.env_args.action_parser={AGENT}:parse", "task.env_args.max_sessions=4", "task.max_turns=3",
            "task.eval_size=2", "task.max_episode_tokens=240"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    run = tmp_path / "oe"
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["samples"] == 4 for r in steps)
    actor = [r for r in records(run, "actor") if "episode_turns_mean" in r]
    assert actor and max(r["episode_turns_mean"] for r in actor) > 1  # multi-step episodes reached the trainer
    assert max(r["episode_env_tokens_mean"] for r in actor) > 0  # the game's feedback turns, masked
    evals = records(run, "eval")
    assert evals[0].get("base") and all(r["num_problems"] == 2 and r["num_failed"] == 0 for r in evals)
    assert sum(1 for r in evals if r.get("final")) == 1  # the final evaluation plays whole games too
