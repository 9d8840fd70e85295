"""The trainer's float32 CPU kernels (cpu_kernels.c), forward and backward: built once per machine like the
engine's (inflight/native/build.py: same compiler flags, cache folder and INFLIGHT_CPU_KERNELS=0 switch), loaded
with ctypes. Callers check `usable(...)` and keep their torch path otherwise."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from inflight.native.build import build_and_open

SOURCE = Path(__file__).with_name("cpu_kernels.c")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ATTENTION = [_P, _I, _I, _P, _I, _I, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _F]
_SIGNATURES = {
    "row_attention_forward": [*_ATTENTION, _P, _P, _P],
    "row_attention_backward": [*_ATTENTION, _P, _P, _P, _P, _P, _P],
    "rms_norm_forward": [_P, _P, _I, _I, _F, _P],
    "rms_norm_backward": [_P, _P, _P, _I, _I, _F, _P, _P],
    "swiglu_forward": [_P, _P, _I, _P],
    "swiglu_backward": [_P, _P, _P, _I, _P, _P],
}


@functools.cache
def lib() -> ctypes.CDLL | None:
    return build_and_open(SOURCE, _SIGNATURES)


def kernels() -> ctypes.CDLL:
    """The built library, for callers that checked `usable()`."""
    found = lib()
    if found is None:
        raise RuntimeError("the trainer's CPU kernels are not built on this machine (check usable() first)")
    return found


def usable(*tensors: torch.Tensor) -> bool:
    """All float32 CPU tensors, torch on one thread, and the library built here. The kernels are single-threaded:
    with 2 threads torch's own ops were faster (small model, SFT batch: a step of 1.59 s with the kernels against
    1.49 s without; on 1 thread 2.62 against 2.73 s)."""
    return (torch.get_num_threads() == 1 and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and lib() is not None)
