"""The float32 CPU kernels of the fast llama forward (cpu_kernels.c): built once per machine with the system's C
compiler, loaded with ctypes, called on tensors' memory.

Why: at our model sizes a decode step on CPU spent more time in small torch ops than in arithmetic. Measured on
the small model at batch 32 (one thread, torch.profiler): `F.rms_norm` took ~50 us per [32, 256] call (it runs
as 6 ops), the decode attention (mask, `baddbmm`, softmax, `bmm`) ~20% of the step, rope and the KV write
another 6 ops per layer, one masked SDPA per prompt chunk, sampling ~8 full-vocabulary passes. The C versions do
each in one pass; bench/engine.py measures the engine with and without them (1.3-1.8x at batch >= 32, up to 2.4x
below), see docs/benchmarks.md.

Built once per machine by inflight/native/build.py; without a compiler, or with INFLIGHT_CPU_KERNELS=0, `load()`
returns None and the runner uses torch ops. The kernels are single-threaded; ctypes releases the GIL while they run.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from inflight.native.build import build_and_open

SOURCE = Path(__file__).with_name("cpu_kernels.c")
MAX_HEAD_DIM = 1024  # rope_and_cache's per-head buffer

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _I, _P, _I, _I, _F, _P],
    "rope_and_cache": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I],
    "cached_attention": [_P, _I, _P, _P, _I, _I, _P, _P, _I, _I, _I, _I, _F, _P, _P],
    "silu_mul": [_P, _I, _I, _P],
    "sample_rows": [_P, _I, _I, _P, _P, _P, _P, _P],
    "copy_count_nonfinite": [_P, _P, _I, _P],
}



@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels library, or None (logged once) where it cannot be built here or is turned off."""
    return build_and_open(SOURCE, _SIGNATURES)


def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and head_dim <= MAX_HEAD_DIM and load() is not None


class Kernels:
    """Typed calls into the library. Callers pass float32 / int64 CPU tensors in the layouts cpu_kernels.c
    states; shapes are the caller's contract (checked in tests against torch references), not re-checked here."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [N, n] (rows may be strided, the last dim contiguous), w [n]; a new [N, n] tensor."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self.lib.rms_norm(x.data_ptr(), x.stride(0), w.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
        return out

    def rope_and_cache(self, qkv: torch.Tensor, H: int, KV: int, D: int, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> None:
        """qkv [N, (H + 2KV) D] contiguous, roped in place; k and v written to caches [slots, KV, T, D]."""
        self.lib.rope_and_cache(qkv.data_ptr(), qkv.shape[0], H, KV, D, cos.data_ptr(), sin.data_ptr(),
                                positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                k_cache.stride(0), k_cache.stride(1))

    def cached_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                         lens: torch.Tensor, max_len: int, scale: float, out: torch.Tensor) -> None:
        """q [nd, H, D] (rows may be strided), caches [slots, KV, T, D], out [nd, H, D] contiguous; each row
        attends to the first lens[row] positions of its slot (max_len = max(lens))."""
        nd, H, D = q.shape
        KV = k_cache.shape[1]
        scratch = torch.empty((H // KV) * max_len, dtype=torch.float32)
        self.lib.cached_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                  k_cache.stride(0), k_cache.stride(1), slots.data_ptr(), lens.data_ptr(), nd, H, KV,
                                  D, scale, out.data_ptr(), scratch.data_ptr())

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [N, 2I] contiguous (gate, up); a new [N, I] tensor silu(gate) * up."""
        n, two_i = gu.shape
        out = torch.empty(n, two_i // 2, dtype=gu.dtype)
        self.lib.silu_mul(gu.data_ptr(), n, two_i // 2, out.data_ptr())
        return out

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] contiguous, temperature and u [B] float32: (tokens [B] int64, logprobs [B] float32), as
        sampling.sample computes them for rows without top-k / top-p."""
        B, V = logits.shape
        tokens = torch.empty(B, dtype=torch.long)
        logprobs = torch.empty(B, dtype=torch.float32)
        scratch = torch.empty(V, dtype=torch.float32)
        self.lib.sample_rows(logits.data_ptr(), B, V, temperature.data_ptr(), u.data_ptr(), tokens.data_ptr(),
                             logprobs.data_ptr(), scratch.data_ptr())
        return tokens, logprobs

    def copy_finite(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """dst.copy_(src) for contiguous float32 tensors of one size; True when every value copied was finite."""
        bad = torch.zeros(1, dtype=torch.int64)
        self.lib.copy_count_nonfinite(src.data_ptr(), dst.data_ptr(), dst.numel(), bad.data_ptr())
        return int(bad) == 0
