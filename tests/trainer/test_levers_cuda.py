"""On a CUDA device only (skipped elsewhere): the GPU halves of the trainer's levers, against float64 references.
- inflight_varlen's kernel (torch's varlen flash attention, bf16): outputs and q/k/v gradients of a packed row
  (GQA) against `reference_varlen` in float64 on the same bf16 inputs;
- the trainer in bf16-mixed on CUDA (attention auto): every layer's attention takes that kernel, none falls back
  (float32 master weights: RoPE hands q / k over in float32);
- the chunked head under bf16 autocast on CUDA: logprobs, entropies and the hidden / weight gradients against the
  plain float64 reference.
    python -m pytest -q tests/trainer/test_levers_cuda.py
"""

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.trainer import head
from inflight.trainer.kernels import varlen
from inflight.trainer.packing import collate
from inflight.trainer.single import SingleDeviceTrainer

from .helpers import ReinforceLoss, random_samples

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_varlen_kernel_against_float64_reference():
    assert varlen.available("cuda")
    lens = [37, 1, 300, 64, 129]
    t = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(t, h, 64, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(True)
               for h in (14, 2, 2))
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    w = torch.randn(t, 14, 64, generator=g, device="cuda")
    out = varlen._cuda_varlen(q, k, v, cu, max(lens), 0.125)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = varlen.reference_varlen(q64, k64, v64, cu, max(lens), 0.125)
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), (q64, k64, v64))
    assert _rel(out, ref) < 1e-2
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) < 2e-2


def test_trainer_takes_the_varlen_kernel_in_bf16(tiny_model_dir):
    t = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(device="cuda", precision="bf16-mixed"))
    t.init()
    assert t.model.config._attn_implementation == varlen.NAME
    batch = collate(random_samples(6, t.model.config.vocab_size, seed=5), [1.0, -1.0] * 3, 6, 100)
    varlen.CALLS.clear()
    t.backward(batch, ReinforceLoss())
    assert dict(varlen.CALLS) == {"kernel": t.model.config.num_hidden_layers}
    assert all(torch.isfinite(p.grad).all() for p in t.model.parameters())


def test_chunked_head_bf16_on_cuda_against_float64():
    g = torch.Generator(device="cuda").manual_seed(1)
    n, hdim, vocab = 3000, 896, 151936
    hidden = torch.randn(n, hdim, generator=g, device="cuda") * 0.5
    weight = torch.randn(vocab, hdim, generator=g, device="cuda") * 0.03
    rows = torch.arange(n - 1, device="cuda")
    targets = torch.randint(0, vocab, (n - 1,), generator=g, device="cuda")
    hb, wb = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    lp, ent = head.head_logprobs(hb, wb, rows, targets, 0.7, True)
    assert lp.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    h64, w64 = hb.detach().double().requires_grad_(True), wb.detach().double().requires_grad_(True)
    logp = torch.log_softmax(h64[rows] @ w64.T / 0.7, -1)
    lp64, ent64 = logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    (lp64.sum() + ent64.sum()).backward()
    assert float((lp.double() - lp64).abs().max()) < 5e-2
    assert float((ent.double() - ent64).abs().max()) < 5e-2
    assert _rel(hb.grad, h64.grad) < 2e-2 and _rel(wb.grad, w64.grad) < 2e-2
