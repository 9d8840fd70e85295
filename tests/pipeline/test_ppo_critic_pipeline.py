"""PPO with a critic (`algo.advantage=gae`) through `inflight train`: servers, actor and trainer as processes, the
critic trained beside the policy, its metrics in every step's record and its state in the checkpoints, from which a
resume continues; on the single trainer and on FSDP2 at 2 ranks (a LoRA critic on FSDP2 is refused at launch)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from inflight.config import RunConfig, load_config
from inflight.pipeline.launch_common import check_ranks
from tests.pipeline.test_end_to_end import overrides, run_train
from tests.reliability.pipeline_helpers import free_base_port, free_port, records

CRITIC_KEYS = ("value_loss", "explained_variance", "value_mean", "value_clip_frac", "returns_mean", "critic_grad_norm",
               "critic_lr")


@pytest.mark.slow
def test_pipelined_run_with_a_critic(tiny_model_dir, tmp_path):
    res = run_train(overrides(tiny_model_dir, tmp_path, "gae", "algo.advantage=gae", "algo.loss=ppo",
                              "critic.lr=1e-3", "critic.warmup_steps=2", "critic.mini_batches=2",
                              "pipeline.max_steps=5", "actor.eval_every=0", "actor.max_new_tokens=48",
                              # a random model earns no reward: DAPO's length penalty gives the returns some spread
                              "algo.truncated=soft_penalty"))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "gae"
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5] and all(r["samples"] == 8 for r in steps)
    for r in steps:
        assert all(k in r and math.isfinite(r[k]) for k in CRITIC_KEYS), r
        assert r["explained_variance"] <= 1.0 and 0.0 <= r["value_clip_frac"] <= 1.0 and r["value_loss"] >= 0.0
        assert r["critic_lr"] == pytest.approx(1e-3)
    assert [r["critic_warmup"] for r in steps] == [True, True, False, False, False]
    assert steps[0]["value_mean"] == 0.0  # the head starts at 0; the critic has trained by step 2
    assert steps[0]["value_loss"] > 0.0 and steps[1]["value_mean"] != 0.0
    # the warm-up left the policy's weights as they were: step 3's samples (lag <= 2: weights v0..v2, all the same
    # weights) are on-policy for the trainer
    assert steps[2]["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and steps[2]["ratio_max"] < 1.01
    final = run / "checkpoints" / "final" / "critic"
    assert (final / "critic.safetensors").is_file() and (final / "train_state.pt").is_file()

    # resumed: the critic continues from the checkpoint (a fresh one's head would give exactly 0 at step 6)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "inflight.cli", "train", "--resume", str(run), "pipeline.max_steps=7",
                          f"server.base_port={free_base_port(2)}", f"pipeline.weight_sync_port={free_port()}"],
                         capture_output=True, text=True, timeout=150, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7]
    assert steps[5]["value_mean"] != 0.0 and not steps[5]["critic_warmup"]


@pytest.mark.slow
def test_fsdp2_pipelined_run_with_a_critic(tiny_model_dir, tmp_path):
    """The critic on trainer.backend=fsdp2 at 2 gloo ranks (sharded like the policy on every rank): a warm-up step,
    the critic's metrics in every record, its checkpoint written by the collective save, and a resume that reads it
    back on both ranks (a fresh head would give exactly 0 values at the resumed step)."""
    res = run_train(overrides(tiny_model_dir, tmp_path, "gae2", "algo.advantage=gae", "algo.loss=ppo",
                              "trainer.backend=fsdp2", "trainer.num_processes=2", "critic.lr=1e-3",
                              "critic.warmup_steps=1", "pipeline.max_steps=3", "actor.eval_every=0",
                              "actor.max_new_tokens=48", "algo.truncated=soft_penalty"))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "gae2"
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["samples"] == 8 and r["ranks"] == 2 for r in steps)
    for r in steps:
        assert all(k in r and math.isfinite(r[k]) for k in CRITIC_KEYS), r
    assert [r["critic_warmup"] for r in steps] == [True, False, False]
    assert steps[0]["value_mean"] == 0.0 and steps[0]["value_loss"] > 0.0 and steps[1]["value_mean"] != 0.0
    assert (run / "checkpoints" / "final" / "critic" / "critic.safetensors").is_file()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "inflight.cli", "train", "--resume", str(run), "pipeline.max_steps=4",
                          f"server.base_port={free_base_port(2)}", f"pipeline.weight_sync_port={free_port()}"],
                         capture_output=True, text=True, timeout=150, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[3]["value_mean"] != 0.0


def test_fsdp2_takes_the_critic_but_not_a_lora_critic():
    """check_ranks at launch: a full critic runs on fsdp2 (critic_fsdp.FSDP2Critic); a LoRA critic is refused there
    (its adapter is not sharded), not deep in the run."""
    args = ["algo.advantage=gae", "trainer.backend=fsdp2", "trainer.num_processes=2", "actor.groups_per_step=2"]
    check_ranks(load_config(RunConfig, None, args))
    with pytest.raises(ValueError, match="trainer.lora runs on the single-device trainer only"):
        check_ranks(load_config(RunConfig, None, [*args, "trainer.lora.rank=4"]))
