"""FSDP2 checkpoints hold the sharded optimizer state: 2 gloo ranks train 2 steps, checkpoint, 2 more; a trainer
resumed from the checkpoint takes the same 2 steps to the same weights (within 1e-6), and one resumed without the
optimizer state ends elsewhere (so the test can fail)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inflight.pipeline import checkpoint as ckpt
from tests.reliability.pipeline_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~35 s: two processes build three sharded trainers each
def test_fsdp2_resume_matches_uninterrupted(tiny_model_dir, tmp_path):
    out, run = tmp_path / "rank0.pt", tmp_path / "run"
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("fsdp_resume_worker.py")), str(tiny_model_dir), str(run),
             str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("FSDP2 ranks timed out")
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
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
