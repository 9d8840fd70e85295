"""`inflight train ... trainer.lora.rank=8`: the whole pipeline (two `inflight serve` processes, trainer, actor)
training a LoRA adapter and pushing only it. On-policy (sync, one step per round) so that every step's behaviour
logprobs come from the weights the trainer holds: a server serving anything but W0 + s * B @ A of the trainer's
adapter would show as a ratio π/μ away from 1."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.pipeline.test_end_to_end import overrides, run_train
from tests.reliability.pipeline_helpers import records

pytestmark = pytest.mark.slow

RANK = 8


def adapter_bytes(model_dir, rank: int, itemsize: int) -> int:
    """A [r, in] + B [out, r] for every linear layer of the blocks (all-linear: not the head)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir)
    n = sum(rank * (mod.in_features + mod.out_features) for name, mod in m.named_modules()
            if isinstance(mod, torch.nn.Linear) and name != "lm_head")
    return n * itemsize


@pytest.mark.parametrize("backend", ["single", "fsdp2"])
def test_lora_run_pushes_adapters_the_servers_serve(tiny_model_dir, tmp_path, backend):
    res = run_train(overrides(tiny_model_dir, tmp_path, "lora", f"trainer.lora.rank={RANK}", "trainer.lora.alpha=16",
                              f"trainer.backend={backend}", "trainer.lr=1e-2", "pipeline.mode=sync",
                              "pipeline.num_grad_steps=1", "pipeline.max_steps=4", "actor.eval_every=0",
                              "actor.max_new_tokens=32", "algo.entropy_coef=1e-6"))
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "lora"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["trainer"]["lora"]["rank"] == RANK
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg["server"]["dtype"]]
    pushes = records(run, "weight_push")
    assert [r["step"] for r in pushes] == [1, 2, 3, 4]
    assert all(r["adapter"] and r["bytes"] == adapter_bytes(tiny_model_dir, RANK, itemsize) for r in pushes)
    for k in (0, 1):  # every server took every version
        versions = [r["weight_version"] for r in records(run, "server_metrics") if r["server"] == k]
        assert versions[-1] == 4 and versions == sorted(versions)
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # on-policy: the trainer's logprobs (base + its adapter) equal the servers' behaviour logprobs
        assert r["lag_max"] == 0
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and r["ratio_max"] < 1.001, r  # measured: 1e-6
    final = run / "checkpoints" / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    from inflight.trainer.lora import read_adapter

    b = [t for n, t in read_adapter(final).items() if ".lora_B." in n]
    assert b and all(float(t.abs().max()) > 0 for t in b)  # trained (B starts at 0)


def test_lora_run_resumes_from_its_adapter(tiny_model_dir, tmp_path):
    """A LoRA run stopped at step 3 and resumed to step 5: servers start from the base, the trainer loads the base
    plus the checkpoint's adapter and pushes that as version 3 before the actor starts; on-policy steps 4-5 then
    show the servers serve exactly the trainer's model again (ratio 1)."""
    import subprocess
    import sys

    from tests.reliability.pipeline_helpers import ports

    args = overrides(tiny_model_dir, tmp_path, "lres", f"trainer.lora.rank={RANK}", "trainer.lr=1e-2",
                     "pipeline.mode=sync", "pipeline.num_grad_steps=1", "pipeline.max_steps=3", "actor.eval_every=0",
                     "actor.max_new_tokens=24", "algo.entropy_coef=1e-6")  # zero-advantage samples train too
    assert run_train(args).returncode == 0
    run = tmp_path / "lres"
    res = subprocess.run([sys.executable, "-m", "inflight.cli", "train", "--resume", str(run), *ports(),
                          "pipeline.max_steps=5"], capture_output=True, text=True, timeout=150,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert [s["resumed_step"] for s in records(run, "run_start")] == [None, 3]
    pushes = records(run, "weight_push")
    assert [r["step"] for r in pushes] == [1, 2, 3, 4, 5] and all(r["adapter"] for r in pushes)
    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps[3:]:
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and r["ratio_max"] < 1.001, r
