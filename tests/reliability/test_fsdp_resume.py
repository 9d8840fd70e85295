"""FSDP2 checkpoints hold the sharded optimizer state: 2 gloo ranks train 2 steps, checkpoint, 2 more; a trainer
resumed from the checkpoint takes the same 2 steps to the same weights (within 1e-6), and one resumed without the
optimizer state ends elsewhere (so the test can fail)."""

from pathlib import Path

import pytest
import torch

from inflight.trainer.loop import checkpoint as ckpt
from tests.trainer.cpu_collectives import run_ranks

WORKER = Path(__file__).with_name("fsdp_resume_worker.py")


@pytest.mark.slow  # ~35 s: two processes build three sharded trainers each
def test_fsdp2_resume_matches_uninterrupted(tiny_model_dir, tmp_path):
    out, run = tmp_path / "rank0.pt", tmp_path / "run"
    run_ranks(WORKER, [tiny_model_dir, run, out])
    got = torch.load(out, weights_only=True)

    path = run / "checkpoints" / "step_000002"
    assert ckpt.is_complete(path) and ckpt.read_state(path).step == 2
    extra = torch.load(path / ckpt.TRAIN_STATE, weights_only=True)  # plain tensors and types
    names = sorted(got["a"])
    assert got["opt_keys"] == names  # the whole optimizer state, unsharded, keyed by parameter name
    for n in names:  # AdamW moments of the full (not sharded) parameter shape, after 2 steps
        s = extra["optimizer"]["state"][n]
        assert s["exp_avg"].shape == got["a"][n].shape and float(s["step"]) == 2.0
        assert float(s["exp_avg_sq"].abs().sum()) > 0
    assert got["versions"] == [4, 4, 4] and got["resumed_step"] == 2
    assert got["lr"][0] == got["lr"][1]

    diff_b = max(float((got["a"][n] - got["b"][n]).abs().max()) for n in names)
    diff_c = max(float((got["a"][n] - got["c"][n]).abs().max()) for n in names)
    print(f"\nFSDP2 resume: max |uninterrupted - resumed| = {diff_b:.2e}; without optimizer state {diff_c:.2e}")
    assert diff_b <= 1e-6
    assert diff_c > 1e-4  # the optimizer state matters: without it the same steps go elsewhere
