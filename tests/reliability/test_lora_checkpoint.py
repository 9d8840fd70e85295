"""trainer.lora checkpoints: they hold the adapter (PEFT's format) and its optimizer state; a trainer resumed from
one (the base from model.path, the adapter from the checkpoint) has bitwise the same adapter and optimizer state
and goes on bit-for-bit like the uninterrupted one; `inflight export-merged` writes a plain HF folder whose logits
are the adapted model's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from inflight.cli import main as cli_main
from inflight.config.trainer import LoraConfig, TrainerConfig
from inflight.trainer.loop import checkpoint as ckpt
from inflight.trainer.single import SingleDeviceTrainer

from .test_checkpoint import state, train_step

torch.set_num_threads(1)
CFG = TrainerConfig(lr=1e-2, schedule="cosine", warmup_steps=2, total_steps=10, threads=1,
                    lora=LoraConfig(rank=4, alpha=8.0))


def _engine(path, cfg=CFG) -> SingleDeviceTrainer:
    e = SingleDeviceTrainer(str(path), cfg)
    e.init()
    return e


def _adapter(e) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in e.named_weights()}


def _same_optimizer_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"]) and a["state"]
    for k, s in a["state"].items():
        assert sorted(s) == sorted(b["state"][k])
        for name, v in s.items():
            assert torch.equal(v, b["state"][k][name]), (k, name)


def test_lora_resume_is_exact(tiny_model_dir, tmp_path):
    a = _engine(tiny_model_dir)
    for s in range(3):
        train_step(a, s)
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", "step_000003", a, state(3))
    assert (path / "adapter_model.safetensors").is_file() and not (path / "model.safetensors").exists()
    saved = torch.load(path / ckpt.TRAIN_STATE, weights_only=True)
    n_adapter = sum(1 for _ in a.named_weights())
    assert len(saved["optimizer"]["state"]) == n_adapter  # moments of the adapter only

    cfg_run = type("Cfg", (), {"trainer": CFG, "model": type("M", (), {"path": str(tiny_model_dir)})})()
    assert ckpt.model_folder(cfg_run, path) == str(tiny_model_dir)  # LoRA resumes load the base
    b = _engine(ckpt.model_folder(cfg_run, path))
    st = ckpt.restore_trainer(b, path)
    assert st.step == 3 and b.version == 3
    before = _adapter(a)
    for n, t in _adapter(b).items():
        assert torch.equal(t, before[n]), n
    _same_optimizer_state(a.optimizer.state_dict(), b.optimizer.state_dict())
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    for s in range(3, 5):
        train_step(a, s)
        train_step(b, s)
    after = _adapter(a)
    for n, t in _adapter(b).items():
        assert torch.equal(t, after[n]), n
    assert any(not torch.equal(after[n], before[n]) for n in after)


def test_lora_and_full_checkpoints_are_not_mixed(tiny_model_dir, tmp_path):
    lora = _engine(tiny_model_dir)
    full = _engine(tiny_model_dir, replace(CFG, lora=None))
    p_lora = ckpt.save_checkpoint(tmp_path / "a", "step_000000", lora, state(0))
    p_full = ckpt.save_checkpoint(tmp_path / "b", "step_000000", full, state(0))
    with pytest.raises(ValueError, match="LoRA adapter: resume it with trainer.lora"):
        ckpt.restore_trainer(_engine(tiny_model_dir, replace(CFG, lora=None)), p_lora)
    with pytest.raises(ValueError, match="full weights: resume it without trainer.lora"):
        ckpt.restore_trainer(_engine(tiny_model_dir), p_full)


def test_export_merged_loads_with_transformers_and_gives_the_adapted_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    e = _engine(tiny_model_dir)
    for s in range(2):
        train_step(e, s)
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", "final", e, state(2))
    out = tmp_path / "merged"
    assert cli_main(["export-merged", str(path), str(out)]) == 0  # the base named by the adapter (model.path)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 14, 20, 7, 30, 11, 4]])
    e.model.eval()
    with torch.no_grad():
        want = e.model(input_ids=ids).logits  # the trainer's adapted (unmerged) forward
        got, plain = merged(input_ids=ids).logits, base(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-4  # the adapter changed the model
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert cli_main(["export-merged", str(tiny_model_dir), str(tmp_path / "x")]) == 2  # no adapter there
