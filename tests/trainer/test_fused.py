"""The trainer's fused RMSNorm and SwiGLU (inflight/trainer/kernels/fused.py, C) against float64 references written here,
and a fused model against the same model unfused (logits and every parameter's gradient)."""

import pytest
import torch

from inflight.trainer.kernels.cpu_kernels import usable
from inflight.trainer.kernels.fused import fuse_modules, rms_norm, swiglu

torch.set_num_threads(1)  # the C kernels serve single-threaded torch only
pytestmark = pytest.mark.skipif(not usable(torch.zeros(1)), reason="no C compiler here")


@pytest.fixture(autouse=True)
def _one_thread():
    """Another test may have left torch on more threads; the kernels only run on one."""
    torch.set_num_threads(1)


def _leaf(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).requires_grad_()


def _grads64(fn, *xs: torch.Tensor, dy: torch.Tensor):
    x64 = [x.detach().double().requires_grad_() for x in xs]
    y = fn(*x64)
    (y * dy.double()).sum().backward()
    return y.detach(), [x.grad for x in x64]


def test_rms_norm_matches_float64():
    x, w = _leaf(2, 7, 24, seed=0, scale=3.0), _leaf(24, seed=1)
    eps = 1e-5

    def ref(x, w):
        r = 1 / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        return w * (x * r)

    y = rms_norm(x, w, eps)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * dy).sum().backward()
    want, (dx, dw) = _grads64(ref, x, w, dy=dy)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), dx, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad.double(), dw, atol=1e-4, rtol=1e-4)


def test_swiglu_matches_float64():
    gate, up = _leaf(5, 40, seed=3, scale=4.0), _leaf(5, 40, seed=4)
    y = swiglu(gate, up)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    (y * dy).sum().backward()
    want, (dg, du) = _grads64(lambda g, u: g * torch.sigmoid(g) * u, gate, up, dy=dy)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gate.grad.double(), dg, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(up.grad.double(), du, atol=1e-5, rtol=1e-4)


def test_fused_model_gives_the_unfused_logits_and_gradients(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    plain, fused = (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32) for _ in range(2))
    layers = plain.config.num_hidden_layers
    assert fuse_modules(fused) == 2 * layers + 1 + layers  # two norms per layer, the final norm, one MLP per layer
    ids = torch.randint(3, plain.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(6))
    out = [m(input_ids=ids, use_cache=False).logits for m in (plain, fused)]
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=1e-5)
    for o in out:
        torch.log_softmax(o, -1)[..., 5].sum().backward()
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (plain, fused)]
    assert max(float(g.abs().max()) for g in grads[0].values()) > 1e-3
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-5, rtol=1e-4)


def test_the_kernels_run_only_on_float32_cpu_with_one_thread(tiny_model_dir, monkeypatch):
    """Where the kernels do not apply (float64, bf16 autocast, 2 threads) transformers' own math runs; on float32
    with one thread the kernels do."""
    from transformers import AutoModelForCausalLM

    from inflight.trainer.kernels import fused

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    fuse_modules(m)
    norm, mlp = m.model.norm, m.model.layers[0].mlp
    calls = []
    for name in ("rms_norm", "swiglu"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))

    def plain_norm(x):
        x32 = x.float()
        return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)

    x = torch.randn(4, m.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(norm(x), plain_norm(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mlp(x.float()).dtype == torch.bfloat16
    torch.set_num_threads(2)
    try:
        torch.testing.assert_close(norm(x.float()), plain_norm(x.float()))
        mlp(x.float())
    finally:
        torch.set_num_threads(1)
    assert calls == []
    norm(x.float()), mlp(x.float())
    assert calls == ["rms_norm", "swiglu"]
