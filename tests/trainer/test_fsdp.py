"""FSDP2 on CPU with 2 gloo processes gives the same 3 optimizer steps as the single-process trainer, on a model with
tied embeddings (the untied path runs in the FSDP2 resume tests): the shared tensor is sharded once, named once in
named_weights() (the contract's canonical name), and save() writes a folder that loads tied."""

from pathlib import Path

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.trainer.packing import pack_samples
from inflight.trainer.single import SingleDeviceTrainer

from .cpu_collectives import run_ranks
from .fsdp_worker import BUDGET, CFG, step_samples
from .helpers import ReinforceLoss

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _single_steps(model_dir, got, cfg, loss_fn):
    """The single-process trainer on all samples of each step; its stats checked against the ranks'."""
    from inflight.trainer.packing import count_loss_tokens

    torch.set_num_threads(1)
    torch.manual_seed(0)
    single = SingleDeviceTrainer(str(model_dir), cfg)
    single.init()
    initial = {n: w.clone() for n, w in single.named_weights()}
    vocab = single.model.config.vocab_size
    for step in range(3):
        samples, adv = step_samples(step, vocab)
        for mb in pack_samples(samples, adv, BUDGET, len(samples), count_loss_tokens(samples)):
            single.backward(mb, loss_fn)
        s = single.optimizer_step()
        assert got["stats"][step]["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-4)
        assert got["stats"][step]["lr"] == pytest.approx(s["lr"])
    return single, initial


@pytest.mark.slow  # ~40 s: two processes load the model and train
def test_fsdp2_two_ranks_equal_single(tied_model_dir, tmp_path):
    tiny_model_dir = tied_model_dir
    out = tmp_path / "rank0.pt"
    run_ranks(WORKER, [tiny_model_dir, out])
    got = torch.load(out, weights_only=True)
    assert got["version"] == 3

    single, initial = _single_steps(tiny_model_dir, got, TrainerConfig(**CFG),
                                    ReinforceLoss(needs_entropy=True, entropy_coef=0.01))
    ref = dict(single.named_weights())
    assert list(got["weights"]) == list(ref)
    moved = 0
    for n in ref:
        torch.testing.assert_close(got["weights"][n], ref[n], atol=2e-5, rtol=1e-4)
        moved += int(not torch.equal(ref[n], initial[n]))
    assert moved >= len(ref) - 1
    assert "lm_head.weight" not in ref
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out.with_suffix(".saved"), dtype=torch.float32)
    assert saved.lm_head.weight is saved.model.embed_tokens.weight
    for n, p in saved.named_parameters():
        torch.testing.assert_close(p.detach(), got["weights"][n])


@pytest.mark.slow  # ~30 s: two processes train a rank-4 adapter
def test_fsdp2_lora_two_ranks_equal_single(tiny_model_dir, tmp_path):
    """A LoRA adapter on FSDP2 (frozen base sharded with trainable adapter): same 3 steps as one process, only the
    adapter trained, saved in PEFT's format and loaded back exactly (in the worker)."""
    from inflight.config.trainer import LoraConfig

    from .fsdp_worker import LORA

    out = tmp_path / "rank0.pt"
    run_ranks(WORKER, [tiny_model_dir, out, "lora"])
    got = torch.load(out, weights_only=True)
    assert got["version"] == 3
    single, initial = _single_steps(tiny_model_dir, got, TrainerConfig(**CFG, lora=LoraConfig(**LORA)),
                                    ReinforceLoss(needs_entropy=True, entropy_coef=0.01))
    ref = dict(single.named_weights())
    assert list(got["weights"]) == list(ref) and all(n.endswith((".lora_A", ".lora_B")) for n in ref)
    for n in ref:
        torch.testing.assert_close(got["weights"][n], ref[n], atol=2e-5, rtol=1e-4)
    assert all(not torch.equal(ref[n], initial[n]) for n in ref if n.endswith(".lora_B"))
    from inflight.trainer.lora import read_adapter

    saved = read_adapter(out.with_suffix(".saved"))
    assert len(saved) == len(ref)
