"""An FSDP2 rank with no trainable samples (all masked by algo.truncated=mask, or fewer groups than ranks) still
joins every collective of the step: 2 gloo ranks, rank 1 empty, give the single-process step on all the samples."""

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

from .fsdp_empty_rank_worker import BUDGET, CFG, step_samples
from .helpers import ReinforceLoss

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~30 s: two processes load the model and take one step
def test_fsdp2_rank_without_samples(tiny_model_dir, tmp_path):
    out, port, procs = tmp_path / "rank0.pt", free_port(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("fsdp_empty_rank_worker.py")), str(tiny_model_dir),
             str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    except subprocess.TimeoutExpired:
        pytest.fail("FSDP2 ranks hung: the rank without samples missed a collective")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
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
