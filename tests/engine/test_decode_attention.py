"""Static-shape decode attention (engine/model/decode_attention.py) against a float64 softmax over each sequence's own
keys: the masked torch path, the split kernel's math in torch (its CPU reference) and the Triton kernel itself under
Triton's CPU interpreter (in a subprocess: TRITON_INTERPRET is read when the kernel is defined, and stays out of
the other tests). The test extra installs triton on Linux (pyproject.toml): missing there, the kernel tests fail."""

from __future__ import annotations

import operator
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from inflight.engine.model import decode_attention as da

REPO = Path(__file__).resolve().parents[2]


def case(dtype=torch.float32, seed=0):
    """GQA 14 query heads over 2 kv heads (Qwen2.5-0.5B's), T=600: three splits; lengths at and across the split
    and block edges, slots out of order, other slots full of large values that must not leak in."""
    g = torch.Generator().manual_seed(seed)
    B, H, KV, D, T, S = 7, 14, 2, 64, 600, 9
    q = torch.randn(B, H, D, generator=g).to(dtype)
    kc = (torch.randn(S, KV, T, D, generator=g) * 2).to(dtype)
    vc = torch.randn(S, KV, T, D, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 8, 2, 7, 1, 5])
    lens = torch.tensor([1, 63, 64, 255, 257, 512, 600])
    for b in range(B):  # garbage past each length
        kc[slots[b], :, lens[b]:] = 1e4
        vc[slots[b], :, lens[b]:] = 1e4
    return q, kc, vc, slots, lens, 1 / 8


def ref64(q, kc, vc, slots, lens, scale):
    B, H, D = q.shape
    rep = H // kc.shape[1]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        k = kc[slots[b], :, :n].double().repeat_interleave(rep, 0)  # [H, n, D]
        v = vc[slots[b], :, :n].double().repeat_interleave(rep, 0)
        a = torch.softmax(torch.einsum("hd,htd->ht", q[b].double(), k) * scale, -1)
        out[b] = torch.einsum("ht,htd->hd", a, v)
    return out


@pytest.mark.parametrize("fn", [da.masked_attention, da.split_reference])
def test_matches_float64(fn):
    args = case()
    err = (fn(*args).double() - ref64(*args)).abs().max().item()
    assert err < 1e-5, err


def test_bfloat16_within_its_rounding():
    args = case(torch.bfloat16)
    for fn in (da.masked_attention, da.split_reference):
        err = (fn(*args).double() - ref64(*args)).abs().max().item()
        assert err < 3e-2, (fn.__name__, err)


def test_combine_of_one_split_is_plain_softmax():
    """One split: combine must return acc / l unchanged; an empty split (m = -inf, l = 0) adds nothing."""
    g = torch.Generator().manual_seed(1)
    m, l, acc = torch.randn(2, 3, 1, generator=g), torch.rand(2, 3, 1, generator=g) + 0.5, torch.randn(2, 3, 1, 4)
    assert torch.allclose(da.combine(m, l, acc), acc[:, :, 0] / l)
    m2 = torch.cat([m, torch.full_like(m, float("-inf"))], -1)
    l2, acc2 = torch.cat([l, torch.zeros_like(l)], -1), torch.cat([acc, torch.zeros_like(acc)], 2)
    assert torch.allclose(da.combine(m2, l2, acc2), acc[:, :, 0] / l)


def patch_index(interpreter) -> None:
    """Triton's interpreter turns a loaded scalar into a 1-element array, and numpy 2 refuses int() of it: the
    interpreted tensor's __index__ reads the array's one element instead. Triton 3.6 and later (3.7.1, 3.9.0
    checked) call `_patch_lang_tensor` with a patch scope (which undoes what it set after the launch), earlier
    versions with the tensor class only. 3.7 and later squeeze the array themselves: the patch changes nothing there."""
    orig = interpreter._patch_lang_tensor

    def index(self):
        return int(np.asarray(self.handle.data).reshape(-1)[0])

    def patched(tensor, *scope):
        orig(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    interpreter._patch_lang_tensor = patched


class _Scope:  # triton 3.6's _LangPatchScope: set_attr records, restore undoes
    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def restore(self):
        while self.changes:
            obj, name, value = self.changes.pop()
            setattr(obj, name, value)


def _tensor_class():
    class Tensor:
        def __init__(self, data):
            self.handle = types.SimpleNamespace(data=data)

        def __index__(self):
            raise AssertionError("not patched")

    return Tensor


@pytest.mark.parametrize("version", ["3.6", "older"])
def test_index_patch_fits_the_interpreters_signature(version):
    """Without Triton: the patch against both signatures of `_patch_lang_tensor`, each setting the numpy-1 style
    __index__ (int() of the array) that the patch must replace."""
    tensor = _tensor_class()
    if version == "3.6":
        def orig(t, scope):
            scope.set_attr(t, "__index__", lambda self: int(self.handle.data))
    else:
        def orig(t):
            t.__index__ = lambda self: int(self.handle.data)
    interpreter = types.SimpleNamespace(_patch_lang_tensor=orig)
    patch_index(interpreter)
    scope = _Scope()
    interpreter._patch_lang_tensor(tensor, *([scope] if version == "3.6" else []))
    assert operator.index(tensor(np.array([7], dtype=np.int32))) == 7
    if version == "3.6":  # after the launch the scope restores the class as it was
        scope.restore()
        with pytest.raises(AssertionError, match="not patched"):
            operator.index(tensor(np.array([7])))


_INTERPRETED = """
import torch
from triton.runtime import interpreter

from tests.engine.test_decode_attention import case, patch_index, ref64

patch_index(interpreter)
from inflight.engine.model import decode_attention as da

for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
    args = case(dtype, seed=2)
    err = (da.split_attention(*args).double() - ref64(*args)).abs().max().item()
    assert err < tol, (dtype, err)
    print("ok", dtype, err)
"""


def require_triton() -> None:
    """Fails on Linux, where the test extra installs triton; skips elsewhere."""
    if da.triton is None:
        if sys.platform == "linux":
            pytest.fail("triton is not installed: `pip install -e '.[test]'` installs it on Linux")
        pytest.skip("triton is not installed (the test extra installs it on Linux only)")


def test_triton_kernel_under_the_interpreter():
    require_triton()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.count("ok") == 2, r.stdout + r.stderr
