"""inflight_varlen (varlen.py): packed attention as one variable-length call per layer. The CUDA kernel (torch's
varlen flash attention) does not run on CPU; here the module's layout code (the packed row, and the shared-prompt
rows laid end to end) runs with `reference_varlen`, the kernel's semantics written plainly, and is checked against
a float64 per-sample causal attention and against the existing packed path (outputs and gradients, through a real
HF model). Also: "auto" picks it on a GPU in bf16, and without the kernel the call is attention.py's path."""

import pytest
import torch
import torch.nn.functional as F

from inflight.config.trainer import TrainerConfig
from inflight.trainer import single, varlen
from inflight.trainer.packing import collate
from inflight.trainer.prefix import shared_layout
from inflight.trainer.single import (
    SingleDeviceTrainer,
    attn_implementation,
    check_config,
)

from .helpers import ReinforceLoss, random_samples
from .test_prefix import group_samples

torch.set_num_threads(1)


def _per_sample_reference(q, k, v, lens, scale):
    """float64: each sample's causal attention on its own, the kv heads repeated by hand (no GQA flag)."""
    rep = q.shape[1] // k.shape[1]
    out, a = [], 0
    for n in lens:
        qs, ks, vs = (x[0, :, a:a + n].double() for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        s = qs @ ks.transpose(1, 2) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
        a += n
    return torch.cat(out)[None]  # [1, T, H, D]


def test_packed_row_equals_per_sample_float64(monkeypatch):
    monkeypatch.setattr(varlen, "CPU_KERNEL", varlen.reference_varlen)
    lens = [5, 1, 12, 7, 3]
    t = sum(lens)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, t, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, t, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, t, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    w = torch.randn(1, t, 4, 8, generator=g, dtype=torch.float64)
    results = []
    for fn in (lambda: varlen.varlen_sdpa(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu,
                                          max_length_q=max(lens))[0],
               lambda: _per_sample_reference(q, k, v, lens, 0.3)):
        out = fn()
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        results.append((out.detach(), *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def _trainer(model_dir, attention, **kw):
    t = SingleDeviceTrainer(str(model_dir), TrainerConfig(attention=attention, **kw))
    t.init()
    return t


@pytest.mark.parametrize("shared", [False, True])
def test_model_equals_packed_path(tiny_model_dir, monkeypatch, shared):
    """Through the trainer (float64 model weights): logprobs, entropies and every gradient equal the packed path's
    (per-bucket SDPA or the C attention), for a packed row of mixed lengths and for shared prompts."""
    monkeypatch.setattr(varlen, "CPU_KERNEL", varlen.reference_varlen)
    ref, new = _trainer(tiny_model_dir, "inflight_packed"), _trainer(tiny_model_dir, "inflight_varlen")
    assert new.model.config._attn_implementation == "inflight_varlen"
    vocab = ref.model.config.vocab_size
    if shared:
        samples = group_samples(vocab, seed=2)
        batch = collate(samples, [1.0 - 0.3 * i for i in range(len(samples))], len(samples), 100)
        assert shared_layout(batch, "cpu") is not None
    else:
        samples = random_samples(9, vocab, seed=8)
        batch = collate(samples, [0.5 * i - 2 for i in range(9)], 9, 100, temperature=0.8)
    calls = []
    monkeypatch.setattr(varlen, "CPU_KERNEL", lambda *a: calls.append(1) or varlen.reference_varlen(*a))
    out = []
    for t in (ref, new):
        t.model.double()
        stats = t.backward(batch, ReinforceLoss(needs_entropy=True, entropy_coef=0.1))
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters()}
        out.append((stats, grads, t.forward_logprobs(batch)))
    assert len(calls) == 2 * new.model.config.num_hidden_layers  # one call per layer (backward, then forward)
    (s0, g0, lp0), (s1, g1, lp1) = out
    assert s1["pg_loss"] == pytest.approx(s0["pg_loss"], abs=1e-12)
    torch.testing.assert_close(lp1, lp0, atol=1e-12, rtol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-12, rtol=1e-9, msg=n)


def test_without_the_kernel_it_is_the_packed_path(tiny_model_dir):
    """CPU without a kernel (the product's CPU case): the same numbers as inflight_packed, exactly."""
    assert varlen.CPU_KERNEL is None and not varlen.available("cpu")
    ref, new = _trainer(tiny_model_dir, "inflight_packed"), _trainer(tiny_model_dir, "inflight_varlen")
    batch = collate(random_samples(6, ref.model.config.vocab_size, seed=9), [1.0] * 6, 6, 100)
    assert torch.equal(new.forward_logprobs(batch), ref.forward_logprobs(batch))


def test_selection(monkeypatch):
    gpu = TrainerConfig(device="cuda", precision="bf16-mixed")
    monkeypatch.setattr(single, "varlen_available", lambda device="cuda": True)
    assert attn_implementation(gpu) == "inflight_varlen"
    assert attn_implementation(TrainerConfig(device="cuda", precision="bf16-mixed",
                                             attention="inflight_packed")) == "inflight_packed"  # the fallback
    assert attn_implementation(TrainerConfig()) == "inflight_packed"  # CPU
    assert attn_implementation(TrainerConfig(device="cuda", precision="float32")) == "inflight_packed"
    monkeypatch.setattr(single, "varlen_available", lambda device="cuda": False)
    assert attn_implementation(gpu) in ("inflight_packed", "flash_attention_2")
    check_config(TrainerConfig(attention="inflight_varlen"))
    with pytest.raises(ValueError, match="trainer.attention"):
        check_config(TrainerConfig(attention="varlen"))


def test_reference_kernel_is_causal_per_sequence():
    """The reference itself against a masked float64 SDPA over the whole row (block-diagonal causal mask)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(11, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    got = varlen.reference_varlen(q, k, v, cu, 6, 0.5)
    doc = torch.tensor([0] * 4 + [1] + [2] * 6)
    mask = (doc[:, None] == doc[None]) & torch.ones(11, 11, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), attn_mask=mask, scale=0.5)
    torch.testing.assert_close(got, ref.transpose(0, 1), atol=1e-12, rtol=0)
