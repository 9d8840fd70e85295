"""trainer.lora: a PEFT adapter on the frozen base, trained alone, pushed alone (names of the weight-update
contract), saved in PEFT's format. References: the base model itself (a fresh adapter changes nothing, bitwise) and
a float64 W0 + s * B @ A computed here from the pushed tensors against PEFT's own merge."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from inflight.config.trainer import LoraConfig, TrainerConfig
from inflight.trainer.packing import pack_samples
from inflight.trainer.single import SingleDeviceTrainer
from inflight.transport.schemas import ParamInfo, adapter_pairs

from .helpers import ReinforceLoss, random_samples

torch.set_num_threads(1)


def _trainer(path, lora: LoraConfig | None, **kw) -> SingleDeviceTrainer:
    t = SingleDeviceTrainer(str(path), TrainerConfig(lr=1e-2, max_grad_norm=1e9, lora=lora, **kw))
    t.init()
    return t


def _batches(trainer, seed: int = 1, n: int = 8):
    samples = random_samples(n, trainer.model.config.vocab_size, seed=seed)
    adv = [float(i % 3) - 1.0 for i in range(n)]
    return pack_samples(samples, adv, 60, n, sum(len(s.completion_ids) for s in samples))


def _step(trainer, seed: int = 1) -> None:
    for mb in _batches(trainer, seed):
        trainer.backward(mb, ReinforceLoss())
    trainer.optimizer_step()


def _base_weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def stepped(tiny_model_dir):
    """A rank-4 adapter after two optimizer steps (B no longer 0)."""
    t = _trainer(tiny_model_dir, LoraConfig(rank=4, alpha=8.0))
    _step(t, 1)
    _step(t, 2)
    return t


def test_only_the_adapter_is_trained_and_held_by_the_optimizer(stepped):
    cfg = stepped.model.config
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    r = 4
    # every linear layer but the head: q, o [h, h]; k, v [kv, h]; gate, up [i, h]; down [h, i]; A [r, in] + B [out, r]
    per_layer = r * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 3)
    trained = {n: p for n, p in stepped.model.named_parameters() if p.requires_grad}
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trained)
    assert sum(p.numel() for p in trained.values()) == per_layer * cfg.num_hidden_layers
    params = [p for g in stepped.optimizer.param_groups for p in g["params"]]
    assert len(params) == len(trained) and all(p.requires_grad for p in params)
    state_bytes = sum(v.numel() * v.element_size() for s in stepped.optimizer.state.values()
                      for k, v in s.items() if k != "step")
    assert state_bytes == 2 * 4 * per_layer * cfg.num_hidden_layers  # exp_avg + exp_avg_sq, float32


def test_fresh_adapter_gives_the_base_logprobs_exactly(tiny_model_dir):
    from inflight.trainer.kernels.fused import fuse_modules

    base = _trainer(tiny_model_dir, None)
    lora = _trainer(tiny_model_dir, LoraConfig(rank=8, alpha=16.0))
    assert fuse_modules(lora.model) > 0  # the fused norm / SwiGLU forwards run over PEFT's linear layers
    for mb in _batches(base, seed=5, n=9):  # packed rows: the C row attention, shared prompts
        assert torch.equal(lora.forward_logprobs(mb), base.forward_logprobs(mb))


def test_a_step_changes_the_adapter_only(stepped, tiny_model_dir):
    base = _base_weights(tiny_model_dir)
    for name, p in stepped.model.named_parameters():
        if ".lora_" in name:
            continue
        assert torch.equal(p, base[name.replace(".base_layer", "")]), name
    bs = [p for n, p in stepped.model.named_parameters() if ".lora_B." in n]
    assert bs and all(p.abs().max() > 0 for p in bs)  # B starts at 0: each was trained


def test_pushed_tensors_are_the_contract_adapter_and_match_peft_merge(stepped, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec = stepped.adapter
    assert spec == {"rank": 4, "scaling": 2.0}
    pushed = dict(stepped.named_weights())
    infos = [ParamInfo(name=n, shape=list(t.shape), dtype="float32") for n, t in pushed.items()]
    pairs = adapter_pairs(infos, spec["rank"])
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    shapes = {n: tuple(p.shape) for n, p in plain.named_parameters()}
    assert len(pairs) == 7 * plain.config.num_hidden_layers
    for b, (a_info, b_info) in pairs.items():
        assert b in shapes and (b_info.shape[0], a_info.shape[1]) == shapes[b]
    # PEFT's merge of the saved adapter against W0 + s * B @ A in float64 from the pushed tensors
    stepped.save(str(tmp_path / "ckpt"))
    merged = PeftModel.from_pretrained(plain, str(tmp_path / "ckpt")).merge_and_unload()
    w0 = _base_weights(tiny_model_dir)
    for name, w in merged.named_parameters():
        if name in pairs:
            a, b = pushed[name + ".lora_A"].double(), pushed[name + ".lora_B"].double()
            ref = w0[name].double() + spec["scaling"] * b @ a
            assert (ref - w0[name].double()).abs().max() > 1e-5  # the adapter moves the weight
            torch.testing.assert_close(w.detach().double(), ref, atol=1e-6, rtol=0)
        else:
            assert torch.equal(w, w0[name]), name


def test_rslora_scaling_and_named_targets(tiny_model_dir):
    t = _trainer(tiny_model_dir, LoraConfig(rank=4, alpha=8.0, rslora=True, target_modules=["q_proj", "v_proj"]))
    assert t.adapter == {"rank": 4, "scaling": pytest.approx(8.0 / math.sqrt(4))}
    names = [n for n, _ in t.named_weights()]
    assert len(names) == 2 * 2 * t.model.config.num_hidden_layers
    assert names[:2] == ["model.layers.0.self_attn.q_proj.weight.lora_A", "model.layers.0.self_attn.q_proj.weight.lora_B"]


@pytest.mark.parametrize("lora, match", [
    (LoraConfig(rank=0), "rank"),
    (LoraConfig(alpha=0.0), "alpha"),
    (LoraConfig(target_modules=[]), "target_modules"),
    (LoraConfig(target_modules=["no_such_layer"]), "no_such_layer|matches no"),
    (LoraConfig(target_modules=["embed_tokens"]), "linear"),
])
def test_bad_lora_config_is_refused(tiny_model_dir, lora, match):
    with pytest.raises(ValueError, match=match):
        _trainer(tiny_model_dir, lora)


def test_tied_head_is_refused(tied_model_dir):
    with pytest.raises(ValueError, match="tied"):
        _trainer(tied_model_dir, LoraConfig(target_modules=["lm_head"]))
    t = _trainer(tied_model_dir, LoraConfig())  # all-linear leaves the tied head alone
    assert not any(n.startswith("lm_head") for n, _ in t.named_weights())


def test_load_adapter_restores_it_bitwise(stepped, tiny_model_dir, tmp_path):
    stepped.save(str(tmp_path / "a"))
    fresh = _trainer(tiny_model_dir, LoraConfig(rank=4, alpha=8.0))
    fresh.load_adapter(str(tmp_path / "a"))
    theirs = dict(stepped.named_weights())
    for name, t in fresh.named_weights():
        assert torch.equal(t, theirs[name]), name
    other = _trainer(tiny_model_dir, LoraConfig(rank=2))
    with pytest.raises(ValueError, match="does not fit"):
        other.load_adapter(str(tmp_path / "a"))


def test_adapter_gradients_through_the_fused_kernels_match_float64(stepped):
    """The adapter's gradients of a packed step (C row attention, fused norm / SwiGLU around PEFT's linears) equal
    a float64 plain forward of each sample alone, of the same loss."""
    import copy

    ref = copy.deepcopy(stepped.model).double()
    stepped.optimizer.zero_grad(set_to_none=True)
    mbs = _batches(stepped, seed=9, n=8)
    assert max(len(mb.seq_lens) for mb in mbs) > 1  # packed rows
    loss = 0.0
    for mb in mbs:
        stepped.backward(mb, ReinforceLoss())
        start = 0
        for n in mb.seq_lens:
            ids = mb.input_ids[start:start + n]
            logits = ref(input_ids=ids[None]).logits[0]
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
            m = mb.loss_mask[start + 1:start + n].double()
            a = mb.advantages[start + 1:start + n].double()
            loss = loss - (a * lp * m).sum() / mb.num_samples_in_step
            start += n
    loss.backward()
    theirs = dict(ref.named_parameters())
    checked = 0
    for name, p in stepped.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.double(), theirs[name].grad, atol=1e-6, rtol=1e-4)
            checked += int(theirs[name].grad.abs().max() > 1e-6)
        else:
            assert p.grad is None
    assert checked > 10
    stepped.optimizer.zero_grad(set_to_none=True)


def test_gradient_checkpointing_gives_the_same_adapter_gradients(tiny_model_dir):
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)  # the same A
        t = _trainer(tiny_model_dir, LoraConfig(rank=4), gradient_checkpointing=ckpt)
        with torch.no_grad():  # B != 0: A gets gradients too
            for n, p in t.model.named_parameters():
                if ".lora_B." in n:
                    p.fill_(0.01)
        for mb in _batches(t, seed=4):
            t.backward(mb, ReinforceLoss())
        grads.append({n: p.grad.clone() for n, p in t.model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(g.abs().max() > 0 for g in grads[0].values())
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-7, rtol=1e-5)
