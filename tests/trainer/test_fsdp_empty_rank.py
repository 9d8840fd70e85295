"""An FSDP2 rank with no trainable samples (all masked by algo.truncated=mask, or fewer groups than ranks) still
joins every collective of the step: 2 gloo ranks, rank 1 empty, give the single-process step on all the samples."""

from pathlib import Path

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.trainer.packing import count_loss_tokens, pack_samples
from inflight.trainer.single import SingleDeviceTrainer

from .cpu_collectives import run_ranks
from .fsdp_empty_rank_worker import BUDGET, CFG, step_samples
from .helpers import ReinforceLoss

WORKER = Path(__file__).with_name("fsdp_empty_rank_worker.py")


@pytest.mark.slow  # ~30 s: two processes load the model and take one step
def test_fsdp2_rank_without_samples(tiny_model_dir, tmp_path):
    out = tmp_path / "rank0.pt"
    run_ranks(WORKER, [tiny_model_dir, out], timeout=150,
              hung="FSDP2 ranks hung: the rank without samples missed a collective")
    got = torch.load(out, weights_only=True)

    torch.set_num_threads(1)
    single = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(**CFG))
    single.init()
    before = {n: w.clone() for n, w in single.named_weights()}
    samples, adv = step_samples(single.model.config.vocab_size)
    for mb in pack_samples(samples, adv, BUDGET, len(samples), count_loss_tokens(samples)):
        single.backward(mb, ReinforceLoss())
    ref = single.optimizer_step()
    assert got["stats"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    for n, w in single.named_weights():
        torch.testing.assert_close(got["weights"][n], w, atol=2e-5, rtol=1e-4)
    assert all(not torch.equal(w, before[n]) for n, w in single.named_weights())  # every tensor moved
