"""Lower-precision generator: the weights the fast llama forward computes with, derived from the full-precision ones.

The engine keeps the HF model in its load dtype (float32 by default) as the master copy: weight updates arrive and
are validated in that dtype (the wire format does not change), are copied into it in place, and then `build()`
derives the generator's weights from it once, inside the same pause. The server's logprobs come from these
derived weights, so the trainer's importance weights see the generator/trainer mismatch.

Precisions (`generator_precision`):
- float32: the master weights themselves, except that on CPU every matrix with at least PACK_MIN_ELEMENTS
  entries is also held pre-packed in oneDNN's blocked layout (PackedLinear): 10-20% faster matmuls at batch
  32-128 than F.linear (MKL) on this CPU, slower below that size (measured 128..768 x 128..2048, 1 thread).
  The packed copy costs one extra copy of those weights in memory and is rebuilt from the master once per update.
- bfloat16: every weight, the activations and the KV cache in bf16.
- bfloat16-fp32-head: bf16 body; the final norm and the output layer in fp32 (as PipelineRL keeps its last layer).
- int8: per-output-channel symmetric int8 weights of every block linear (fused qkv, o, fused gate-up, down),
  run by PyTorch's fbgemm dynamic-quantized linear (activations quantized per tensor on the fly, 7-bit range so the
  AVX2 u8*s8 pair sums cannot saturate); embedding, norms, attention and the output layer stay fp32. CPU only.
  Why this kernel: on this AVX2 CPU (1 thread, shapes 256..8192 x 256..1024, batch 32/128) it ran 2.5-8x faster
  than fp32 F.linear, while the weight-only int8 routes were slower than fp32: torchao Int8WeightOnlyConfig
  1.1-1.8x slower, int8 weight + dequant + matmul 1.0-1.7x slower, torch._weight_int8pack_mm 30x slower in fp32
  (1.1-1.3x slower in bf16). Numbers: bench/precision.py (header and output).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from inflight.config.engine import PRECISIONS  # the values of server.generator_precision

log = logging.getLogger(__name__)


def check_precision(precision: str, device: torch.device | str = "cpu") -> None:
    """Raises ValueError naming the problem."""
    if precision not in PRECISIONS:
        raise ValueError(f"generator_precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision == "int8" and torch.device(device).type != "cpu":
        raise ValueError("generator_precision int8 runs on CPU only (fbgemm); use bfloat16 on a GPU")
    if precision == "int8":
        log.warning("generator_precision int8 quantizes activations with one scale per batch: on real checkpoints "
                    "the sampling policy can be far from float32's (SmolLM2-135M: KL 0.72 per token); measure your "
                    "model with bench/precision.py --mismatch-model PATH first")


def compute_dtype(precision: str, master: torch.dtype) -> torch.dtype:
    """dtype of the activations and the KV cache."""
    return torch.bfloat16 if precision.startswith("bfloat16") else master


class Int8Linear:
    """y = x @ w.T + b with w as per-row int8 (fbgemm prepacked) and x quantized per call to 7-bit uint8."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        w = w.detach().float()
        scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao, slower here
            warnings.simplefilter("ignore", UserWarning)
            qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None if b is None else b.detach().float())
        self.out_features = w.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)


# out * in; smaller matrices ran slower packed than through F.linear. The env var exists for tests and tuning.
PACK_MIN_ELEMENTS = int(os.environ.get("INFLIGHT_PACK_MIN_ELEMENTS", 1 << 17))


def packing_available(device: torch.device | str = "cpu") -> bool:
    """oneDNN pre-packed float32 linears: CPU builds with mkldnn and its linear ops only."""
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear:
    """y = x @ w.T + b with w reordered once into oneDNN's blocked layout (a copy: rebuild it after an update)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().float().contiguous())
        self.bias = None if b is None else b.detach().float().contiguous()
        self.out_features = w.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def residual(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + h @ w.T + b, the add fused into the matmul."""
        return torch.ops.mkldnn._linear_pointwise.binary(h, x, self.packed, self.bias, "add")


Weight = Union[torch.Tensor, Int8Linear, PackedLinear]


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain weight; Int8Linear / PackedLinear carry their own bias."""
    return F.linear(x, w, b) if isinstance(w, torch.Tensor) else w(x)


def residual(x: torch.Tensor, h: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """x + h @ w.T (+ b); for a plain or packed weight the add is fused into the matmul."""
    if isinstance(w, PackedLinear):
        return w.residual(x, h)
    if not isinstance(w, torch.Tensor):
        return w(h).add_(x)
    y = torch.addmm(x, h, w.t())
    return y if b is None else y.add_(b)


@dataclass
class GeneratorWeights:
    embed: torch.Tensor  # [vocab, hidden] in the compute dtype
    layers: list[dict]  # same keys as LlamaRunner's master layers
    norm: torch.Tensor  # final norm weight, in head_dtype
    head: Weight  # output layer weight, in head_dtype (plain or packed)
    head_bias: torch.Tensor | None  # None when head carries its own
    head_dtype: torch.dtype  # dtype the last hidden state is cast to before the final norm


_MATRICES = ("w_qkv", "wo", "w_gu", "wd")
_BIASES = {"w_qkv": "b_qkv", "wo": "bo"}


def _pack_large(w: torch.Tensor, b: torch.Tensor | None) -> tuple[Weight, torch.Tensor | None]:
    if w.dtype != torch.float32 or w.numel() < PACK_MIN_ELEMENTS:
        return w, b
    return PackedLinear(w, b), None


def build(precision: str, embed: torch.Tensor, layers: list[dict], norm: torch.Tensor, head: torch.Tensor,
          head_bias: torch.Tensor | None, pack: bool = True) -> GeneratorWeights:
    """The generator's weights from the master ones (called on load and once after every weight update).
    pack: allow oneDNN pre-packed float32 matrices (used only where packing_available())."""
    master = embed.dtype
    if precision == "float32":  # the master tensors themselves, large matrices also pre-packed where possible
        if not (pack and packing_available(embed.device)):
            return GeneratorWeights(embed, layers, norm, head, head_bias, master)
        players = []
        for L in layers:
            q = dict(L)
            for k in _MATRICES:
                bias = _BIASES.get(k)
                q[k], b = _pack_large(L[k], L[bias] if bias else None)
                if bias:
                    q[bias] = b
            players.append(q)
        phead, phead_bias = _pack_large(head, head_bias)
        return GeneratorWeights(embed, players, norm, phead, phead_bias, master)
    if precision == "int8":
        qlayers = []
        for L in layers:
            q = dict(L)
            for k in _MATRICES:
                bias = _BIASES.get(k)
                q[k] = Int8Linear(L[k], L[bias] if bias else None)
                if bias:
                    q[bias] = None
            qlayers.append(q)
        return GeneratorWeights(embed, qlayers, norm, head, head_bias, master)
    dt = torch.bfloat16
    blayers = [{k: (v.detach().to(dt) if isinstance(v, torch.Tensor) else v) for k, v in L.items()} for L in layers]
    head_dt = torch.float32 if precision == "bfloat16-fp32-head" else dt
    hbias = None if head_bias is None else head_bias.detach().to(head_dt)
    return GeneratorWeights(embed.detach().to(dt), blayers, norm.detach().to(head_dt), head.detach().to(head_dt),
                            hbias, head_dt)


def _pairs(gen: GeneratorWeights, embed, layers, norm, head, head_bias):
    yield gen.embed, embed
    for G, L in zip(gen.layers, layers):
        for k, v in L.items():
            if isinstance(v, torch.Tensor) or isinstance(G[k], torch.Tensor):
                yield G[k], v
    yield gen.norm, norm
    yield gen.head, head
    yield gen.head_bias, head_bias


def refresh(gen: GeneratorWeights, precision: str, embed: torch.Tensor, layers: list[dict], norm: torch.Tensor,
            head: torch.Tensor, head_bias: torch.Tensor | None) -> bool:
    """After an update of the master weights: copy them into `gen`'s own tensors in place (a bf16 copy is
    re-rounded, a float32 generator already is the master), so every tensor keeps its address (what a captured
    CUDA graph reads). False, changing nothing, when `gen` holds something that is not a plain tensor (int8 or
    packed matrices: rebuild those)."""
    pairs = list(_pairs(gen, embed, layers, norm, head, head_bias))
    if any((g is None) != (m is None) or (g is not None and not isinstance(g, torch.Tensor)) for g, m in pairs):
        return False
    with torch.no_grad():
        for g, m in pairs:
            if g is not None and g is not m:
                g.copy_(m)
    return True
