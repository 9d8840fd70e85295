"""trainer.gradient_checkpointing auto|true|false (memory.py): the decision on given numbers on both sides of the
threshold, the config accepting the values, the activation estimate against what autograd really saves on a
real model, and the fused-AdamW choice (optim.py)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from inflight.config import ConfigError, RunConfig, load_config
from inflight.config.trainer import TrainerConfig
from inflight.trainer import memory
from inflight.trainer.optim import build_optimizer, fused_supported
from inflight.trainer.single import SingleDeviceTrainer, check_config

GiB = 1 << 30


def test_decision_on_given_numbers():
    # Qwen2.5-0.5B's shape, bf16-mixed, one rank, 16k tokens; the numbers worked out by hand from the docstrings
    qwen = AutoConfig.for_model("qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)
    per_token = memory.activation_bytes_per_token(qwen, "bf16-mixed")
    # a layer: 2 B x (18 x 896 + 2 x 128 (2 kv heads of 64) + 4 x 4864) = 2 x 35_840 = 71_680 B;
    # 24 layers 1_720_320 B, + the chunked head's 3 float32 hidden vectors 12 x 896 = 10_752 B
    assert per_token == 1_731_072
    n = 494_032_768
    states = memory.state_bytes(n, n, "bf16-mixed")
    assert states == 8_892_589_824  # (4 + 12 + 2) B x 494_032_768
    # states + 16_384 tokens x 1_731_072 B = 8_892_589_824 + 28_361_883_648 (~34.7 GiB)
    need = 37_254_473_472
    assert not memory.needs_checkpointing(states, per_token, 16384, 139 * GiB)  # an H200: off
    assert memory.needs_checkpointing(states, per_token, 16384, 40 * GiB)  # a 40 GB card: on
    threshold = 46_568_091_840  # need / (1 - 0.2): 20% kept free
    assert threshold * (1 - memory.MARGIN) == need
    assert not memory.needs_checkpointing(states, per_token, 16384, threshold)
    assert memory.needs_checkpointing(states, per_token, 16384, threshold - 1)
    # sharding over 8 ranks divides the float32 states, not the bf16 copies: 16 B x n / 8 + 2 B x n = 4 B x n
    assert memory.state_bytes(n, n, "bf16-mixed", 8) == 1_976_131_072
    assert memory.state_bytes(n, 0, "float32") == 1_976_131_072  # frozen (LoRA base): 4 B x n, nothing else
    assert memory.state_bytes(n, 0, "bf16-mixed") == 2_964_196_608  # frozen: 4 B + its 2 B bf16 copy, x n
    # the full-logits head: 151_936 x (2 B bf16 logits + 4 B float32 copy) = 911_616 B instead of 10_752 B
    assert memory.activation_bytes_per_token(qwen, "bf16-mixed", chunked_head=False) == 1_720_320 + 911_616


@pytest.mark.parametrize("frozen", [False, True])
def test_state_estimate_is_what_an_adamw_step_holds(tiny_model_dir, frozen):
    """float32, one rank: after a step of the trainer's AdamW, the bytes of the weights, their gradients and the
    optimizer's state (its step counters aside) are the estimate; with the embeddings frozen (as a LoRA base) they
    get neither gradients nor moments."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if frozen:
        model.get_input_embeddings().weight.requires_grad_(False)
    params = list(model.parameters())
    opt, _ = build_optimizer(params, TrainerConfig())
    ids = torch.randint(4, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    held = {}
    for p in params:
        for t in (p, p.grad):
            if t is not None:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for state in opt.state.values():
        for k, t in state.items():
            if k != "step":
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    n = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    assert (trained < n) == frozen
    assert memory.state_bytes(n, trained, "float32") == sum(held.values())


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("true", True), ("false", False)])
def test_config_accepts_auto_true_false(value, expected):
    cfg = load_config(RunConfig, None, [f"trainer.gradient_checkpointing={value}"]).trainer
    assert memory.parse_choice(cfg.gradient_checkpointing) == expected
    check_config(cfg)


def test_bad_choice_is_a_clear_error():
    cfg = load_config(RunConfig, None, ["trainer.gradient_checkpointing=sometimes"]).trainer
    with pytest.raises(ValueError, match="gradient_checkpointing must be auto, true or false"):
        check_config(cfg)
    with pytest.raises(ConfigError):
        load_config(RunConfig, None, ["trainer.gradient_checkpointing=[1]"])


def test_auto_on_the_trainer(tiny_model_dir, monkeypatch):
    """auto follows the available memory: plenty -> no checkpointing; a few MB -> checkpointing."""
    for avail, on in ((64 * GiB, False), (1 << 20, True)):
        monkeypatch.setattr(memory, "available_bytes", lambda device, a=avail: a)
        t = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(gradient_checkpointing="auto"))
        t.init()
        assert t.model.is_gradient_checkpointing == on


def test_activation_estimate_bounds_what_autograd_saves(tiny_model_dir):
    """float32, no checkpointing: the bytes autograd saves for backward per token (unique storages, parameters
    excluded) are at most the estimate, and at least half of it (the estimate is not wildly loose)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(4, model.config.vocab_size, (8, 40), generator=torch.Generator().manual_seed(1))
    seen = {}

    def pack(x):
        s = x.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = model(input_ids=ids, use_cache=False).logits
    logits_bytes = out.numel() * 4  # the full-logits model: not the chunked head's part of the estimate
    per_token = (sum(seen.values()) - logits_bytes) / ids.numel()
    est = memory.activation_bytes_per_token(model.config, "float32", chunked_head=True)
    assert 0.5 * est <= per_token <= est, (per_token, est)


def test_fused_adamw_choice():
    assert fused_supported({"cuda"}, True, sharded=False)
    assert fused_supported({"cuda"}, True, sharded=True)  # FSDP2's DTensors on CUDA
    assert fused_supported({"cpu"}, True, sharded=False)
    assert not fused_supported({"cpu"}, True, sharded=True)  # sharded CPU (gloo) runs: unchanged
    assert not fused_supported({"cuda"}, False, sharded=False)
    assert not fused_supported({"cuda", "cpu"}, True, sharded=False)
    assert not fused_supported(set(), True, sharded=False)
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    assert build_optimizer(params, TrainerConfig())[0].defaults["fused"] is True
    assert not build_optimizer(params, TrainerConfig(fused_optimizer=False))[0].defaults["fused"]
