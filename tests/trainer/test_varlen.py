"""inflight_varlen (varlen.py): packed attention as one variable-length call per layer. The CUDA kernel (torch's
varlen flash attention) does not run on CPU; here the module's layout code (the packed row, and the shared-prompt
rows laid end to end) runs with `reference_varlen`, the kernel's semantics written plainly, and is checked against
a float64 per-sample causal attention and against the existing packed path (outputs and gradients, through a real
HF model). Also: "auto" picks it on a GPU in bf16, and without the kernel the call is attention.py's path."""

import pytest
import torch
import torch.nn.functional as F

from inflight.config.trainer import TrainerConfig
from inflight.trainer import single
from inflight.trainer.kernels import varlen
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


def _torch_2_11_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                            window_size=(-1, -1)):
    """torch 2.11's varlen_attn signature (no `enable_gqa`: it came in 2.12), causal ((-1, 0)) only, on CPU; like
    2.11's kernel it takes as many kv heads as query heads."""
    assert return_aux is None and window_size == (-1, 0) and cu_seq_k is cu_seq_q and max_k == max_q
    assert key.shape[1] == query.shape[1], "2.11 has no enable_gqa: the kv heads must be expanded"
    return varlen.reference_varlen(query, key, value, cu_seq_q, max_q, scale)


def test_cuda_call_fits_torch_2_11_without_enable_gqa(monkeypatch):
    """The CUDA call (`_cuda_varlen`) against torch 2.11's signature: no enable_gqa keyword, so the kv heads are
    repeated before the call; the result is the GQA attention, outputs and gradients."""
    import torch.nn.attention.varlen as tv

    monkeypatch.setattr(tv, "varlen_attn", _torch_2_11_varlen_attn)
    lens = [5, 1, 9]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens), 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lens), 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    out = varlen._cuda_varlen(q, k, v, cu, max(lens), 0.3)
    ref = _per_sample_reference(*(x.transpose(0, 1)[None] for x in (q, k, v)), lens, 0.3)[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_call_uses_the_keywords_a_torch_has():
    """enable_gqa and scale passed where the signature has them (2.12+); is_causal where window_size is absent
    (2.9); a missing `scale` is applied to the query (the kernel's default is 1 / sqrt(D))."""
    seen = []

    def newer(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.append(("newer", k.shape[1], scale, window_size, enable_gqa))
        return varlen.reference_varlen(q, k, v, cu_q, max_q, scale)

    def older(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        seen.append(("older", k.shape[1], is_causal))
        return varlen.reference_varlen(q, k, v, cu_q, max_q, q.shape[-1] ** -0.5)

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(7, h, 4, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    want = varlen.reference_varlen(q, k, v, cu, 4, 0.7)
    for fn in (newer, older):
        torch.testing.assert_close(varlen.call_varlen(fn, q, k, v, cu, 4, 0.7), want, atol=1e-12, rtol=0)
    assert seen == [("newer", 2, 0.7, (-1, 0), True), ("older", 4, True)]


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_trainer_takes_the_varlen_path_whatever_rope_returns(tiny_model_dir, monkeypatch, precision):
    """With the lever on (attention=inflight_varlen), every layer's attention goes to the varlen kernel, with q, k
    and v in the compute dtype: under bf16 autocast RoPE hands q / k over in float32 (float32 cos / sin times the
    bf16 projections) while v is bf16; the flash kernel takes half precision only, so the decision and the inputs
    must follow autocast's dtype, not RoPE's."""
    monkeypatch.setattr(varlen, "CPU_KERNEL", varlen.reference_varlen)
    t = _trainer(tiny_model_dir, "inflight_varlen", precision=precision)
    dtypes = []

    def kernel(q, k, v, *rest):
        dtypes.append((q.dtype, k.dtype, v.dtype))
        return varlen.reference_varlen(q, k, v, *rest)

    monkeypatch.setattr(varlen, "CPU_KERNEL", kernel)
    batch = collate(random_samples(6, t.model.config.vocab_size, seed=5), [1.0, -1.0] * 3, 6, 100)
    stats = t.backward(batch, ReinforceLoss())
    assert torch.isfinite(torch.tensor(stats["pg_loss"]))
    want = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    assert dtypes == [(want, want, want)] * t.model.config.num_hidden_layers
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in t.model.parameters() if p.requires_grad)
    for fallback in (torch.float32, torch.float64):  # on CUDA: the flash kernel only in half precision
        assert varlen._kernel(torch.device("cuda"), fallback) is None
