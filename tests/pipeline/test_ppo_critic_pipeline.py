"""PPO with a critic (`algo.advantage=gae`) through `inflight train`: servers, actor and trainer as processes, the
critic trained beside the policy, its metrics in every step's record and its state in the checkpoints, from which a
resume continues; on the single trainer and on FSDP2 at 2 ranks, in full and with trainer.lora (the critic's own
adapter and head, sharded like the LoRA policy)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

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
@pytest.mark.parametrize("lora, n", [(True, 2)], ids=["lora"])  # the full critic on fsdp2: test_fsdp.py, save/load too
def test_fsdp2_pipelined_run_with_a_critic(tiny_model_dir, tmp_path, lora, n):
    """The critic on trainer.backend=fsdp2 at 2 gloo ranks (sharded like the policy on every rank): a warm-up step,
    the critic's metrics in every record, its checkpoint written by the collective save, and a resume that reads it
    back on both ranks (a fresh head would give exactly 0 values at the resumed step). With trainer.lora the critic
    trains its own adapter and the head: its checkpoint holds those only (a step fewer: a LoRA run costs more)."""
    extra = ["trainer.lora.rank=4", "trainer.lora.alpha=8"] if lora else []
    res = run_train(overrides(tiny_model_dir, tmp_path, "gae2", "algo.advantage=gae", "algo.loss=ppo",
                              "trainer.backend=fsdp2", "trainer.num_processes=2", "critic.lr=1e-3",
                              "critic.warmup_steps=1", f"pipeline.max_steps={n}", "actor.eval_every=0",
                              "actor.max_new_tokens=48", "algo.truncated=soft_penalty", *extra))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "gae2"
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == list(range(1, n + 1))
    assert all(r["samples"] == 8 and r["ranks"] == 2 for r in steps)
    for r in steps:
        assert all(k in r and math.isfinite(r[k]) for k in CRITIC_KEYS), r
    assert [r["critic_warmup"] for r in steps] == [True] + [False] * (n - 1)
    assert steps[0]["value_mean"] == 0.0 and steps[0]["value_loss"] > 0.0 and steps[1]["value_mean"] != 0.0
    saved = load_file(str(run / "checkpoints" / "final" / "critic" / "critic.safetensors"))
    assert {"lm_head.weight", "lm_head.bias"} <= set(saved)
    assert all(".lora_" in n or n.startswith("lm_head") for n in saved) == lora and len(saved) > 4, sorted(saved)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "inflight.cli", "train", "--resume", str(run),
                          f"pipeline.max_steps={n + 1}",
                          f"server.base_port={free_base_port(2)}", f"pipeline.weight_sync_port={free_port()}"],
                         capture_output=True, text=True, timeout=150, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == list(range(1, n + 2)) and steps[n]["value_mean"] != 0.0


def test_fsdp2_takes_a_full_and_a_lora_critic():
    """check_ranks at launch: a critic runs on fsdp2 in full and with trainer.lora (critic_fsdp.FSDP2Critic); an
    uneven share is still refused (the check runs on)."""
    args = ["algo.advantage=gae", "trainer.backend=fsdp2", "trainer.num_processes=2", "actor.groups_per_step=2"]
    check_ranks(load_config(RunConfig, None, args))
    check_ranks(load_config(RunConfig, None, [*args, "trainer.lora.rank=4"]))
    with pytest.raises(ValueError, match="must be a multiple of trainer.num_processes"):
        check_ranks(load_config(RunConfig, None, [*args, "trainer.lora.rank=4", "actor.groups_per_step=3"]))
