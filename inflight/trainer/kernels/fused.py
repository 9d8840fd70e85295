"""RMSNorm and SwiGLU of Llama-family models as single C passes, forward and backward (cpu_kernels.c).

Why: with the matrix multiplies near the core's peak, the trainer's step on the CPU demo spent ~15% in the
elementwise ops around them (torch.profiler): transformers' RMSNorm is 6 ops forward (upcast, pow, mean, add, rsqrt,
two muls) and more backward, its MLP's silu(gate) * up is 2 ops forward and 4 backward, each a full pass over
memory. One pass each way here; bench/trainer.py --rl-step times the step against an earlier commit
(docs/benchmarks.md).

`fuse_modules(model)` swaps the forward of the modules it knows (by class: Llama, Qwen2, Qwen3, Mistral RMSNorm and
MLP with `silu`) for these, on the model instance only. The swapped forward falls back to the class's own for
anything but float32 CPU tensors on single-threaded torch (bf16 autocast, GPU, trainer.threads > 1). The math is
transformers' own: y = w * (x * r) with r = rsqrt(mean(x^2) + eps) in float32, and down(silu(gate(x)) * up(x)).
"""

from __future__ import annotations

import types

import torch

from inflight.trainer.kernels.cpu_kernels import kernels, lib, usable

NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.empty_like(x2)
        kernels().rms_norm_forward(x2.data_ptr(), weight.data_ptr(), x2.shape[0], x2.shape[1], eps, y.data_ptr())
        ctx.save_for_backward(x2, weight)
        ctx.eps, ctx.shape = eps, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        dy = dy.reshape(x2.shape).contiguous()
        dx, dw = torch.empty_like(x2), torch.zeros_like(weight)
        kernels().rms_norm_backward(x2.data_ptr(), weight.data_ptr(), dy.data_ptr(), x2.shape[0], x2.shape[1], ctx.eps,
                                dx.data_ptr(), dw.data_ptr())
        return dx.view(ctx.shape), dw, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        kernels().swiglu_forward(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        kernels().swiglu_backward(gate.data_ptr(), up.data_ptr(), dout.data_ptr(), gate.numel(), dgate.data_ptr(),
                              dup.data_ptr())
        return dgate, dup


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, float(eps))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not usable(hidden_states, self.weight):
        return type(self).forward(self, hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not usable(gate, up):
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(swiglu(gate, up))


def fuse_modules(model: torch.nn.Module) -> int:
    """Swap in the fused forwards where the module is one of the known classes; returns how many were swapped
    (0 where the library cannot be built here)."""
    if lib() is None:
        return 0
    act = getattr(getattr(model, "config", None), "hidden_act", None)
    n = 0
    for m in model.modules():
        name = type(m).__name__
        if name in NORMS and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_norm_forward, m)
            n += 1
        elif name in MLPS and act == "silu" and all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")):
            m.forward = types.MethodType(_mlp_forward, m)
            n += 1
    return n
