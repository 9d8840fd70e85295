"""The FSDP2 backend at one rank holds the plain module (nothing to shard: no per-block copies or hooks) and takes
the single-device trainer's optimizer step: weights after one step equal, as they do with sharding forced on
(trainer.fsdp_shard_one_rank)."""

from pathlib import Path

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.trainer.packing import count_loss_tokens, pack_samples
from inflight.trainer.single import SingleDeviceTrainer

from .cpu_collectives import run_ranks
from .fsdp_worker import BUDGET, CFG, step_samples
from .helpers import ReinforceLoss

WORKER = Path(__file__).with_name("fsdp_one_rank_worker.py")


def _one_rank(model_dir, out, *extra):
    run_ranks(WORKER, [model_dir, out, *extra], world_size=1, hung="the FSDP2 rank timed out")
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
