"""The FSDP2 backend at one rank holds the plain module (nothing to shard: no per-block copies or hooks) and takes
the single-device trainer's optimizer step: weights after one step equal, as they do with sharding forced on
(trainer.fsdp_shard_one_rank)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.trainer.packing import count_loss_tokens, pack_samples
from inflight.trainer.single import SingleDeviceTrainer
from tests.reliability.pipeline_helpers import free_port

from .fsdp_worker import BUDGET, CFG, step_samples
from .helpers import ReinforceLoss

ROOT = Path(__file__).resolve().parents[2]


def _one_rank(model_dir, out, *extra):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("fsdp_one_rank_worker.py")), str(model_dir),
                        str(out), *extra], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.slow  # ~30 s: two subprocesses load the model and train a step
def test_one_rank_is_the_plain_module_and_equals_single(tied_model_dir, tmp_path):
    plain = _one_rank(tied_model_dir, tmp_path / "plain.pt")
    sharded = _one_rank(tied_model_dir, tmp_path / "sharded.pt", "shard")
    assert plain["sharded"] is False and sharded["sharded"] is True

    torch.set_num_threads(1)
    single = SingleDeviceTrainer(str(tied_model_dir), TrainerConfig(**CFG))
    single.init()
    initial = {n: w.clone() for n, w in single.named_weights()}
    samples, adv = step_samples(0, single.model.config.vocab_size)
    loss = ReinforceLoss(needs_entropy=True, entropy_coef=0.01)
    for mb in pack_samples(samples, adv, BUDGET, len(samples), count_loss_tokens(samples)):
        single.backward(mb, loss)
    stats = single.optimizer_step()
    ref = dict(single.named_weights())
    for got in (plain, sharded):
        assert got["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
        assert list(got["weights"]) == list(ref)
        for n in ref:
            torch.testing.assert_close(got["weights"][n], ref[n], atol=2e-5, rtol=1e-4)
    assert sum(not torch.equal(ref[n], initial[n]) for n in ref) == len(ref)  # the step moved every tensor
