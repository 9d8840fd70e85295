"""float32 generator with oneDNN pre-packed matrices (precision.PackedLinear): same numbers as the master weights,
rebuilt on every weight update, and off where it cannot run. Reference: float64 matmuls / float64 HF forwards."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from inflight.engine.core import InferenceEngine
from inflight.engine.model import precision as prec
from tests.engine.test_precision import BOUND, _errors, _generate, _new_weights, sharp_model_dir  # noqa: F401

torch.set_num_threads(1)
needs_mkldnn = pytest.mark.skipif(not prec.packing_available("cpu"), reason="no oneDNN linear ops in this torch")


def _packed(runner) -> list[bool]:
    g = runner.gen
    mats = [L[k] for L in g.layers for k in ("w_qkv", "wo", "w_gu", "wd")] + [g.head]
    return [isinstance(w, prec.PackedLinear) for w in mats]


@needs_mkldnn
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_matches_float64(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    x, r = torch.randn(rows, 80, generator=g), torch.randn(rows, 96, generator=g)
    lin = prec.PackedLinear(w, b)
    want = x.double() @ w.double().T + b.double()
    assert (lin(x).double() - want).abs().max().item() < 1e-4
    assert (prec.residual(r, x, lin, None).double() - (want + r.double())).abs().max().item() < 1e-4
    assert (prec.linear(x, lin).double() - want).abs().max().item() < 1e-4


def _wait_repacked(runner, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (runner._repacker.ready or all(_packed(runner))):  # waiting for a step boundary, or already in
        assert time.monotonic() < deadline, "the background re-pack never finished"
        time.sleep(0.01)


@needs_mkldnn
def test_packed_generator_rebuilt_on_weight_update(sharp_model_dir, monkeypatch):
    """The pause points the generator at the new master tensors (unpacked, correct at once); the packed copies are
    rebuilt in the background and swapped in at a step boundary. Every token, before and after the swap, has the
    new weights' logprobs."""
    monkeypatch.setattr(prec, "PACK_MIN_ELEMENTS", 0)  # the tiny model's matrices are below the real threshold
    eng = InferenceEngine(str(sharp_model_dir), max_batch=4, max_model_len=64)
    assert all(_packed(eng.runner))
    eng.start()
    try:
        before = asyncio.run(_generate(eng, temperature=1.0))
        old_head = eng.runner.gen.head
        new = _new_weights(sharp_model_dir, seed=1)
        builds = eng.runner.weight_builds
        asyncio.run(eng.run_paused(lambda: eng.load_weights(new, version=1)))
        assert eng.runner.weight_builds == builds + 1 and not any(_packed(eng.runner))  # not re-packed in the pause
        assert eng.runner.gen.head is eng.model.lm_head.weight  # the master itself: the new values
        right_after = asyncio.run(_generate(eng, temperature=1.0))
        _wait_repacked(eng.runner)
        after = asyncio.run(_generate(eng, temperature=1.0))  # its first step swaps the packed copies in
        assert all(_packed(eng.runner)) and eng.runner.gen.head is not old_head
    finally:
        eng.stop()
    assert max(_errors(sharp_model_dir, None, before)) <= BOUND["float32"][1]
    assert max(_errors(sharp_model_dir, new, right_after)) <= BOUND["float32"][1]
    assert max(_errors(sharp_model_dir, new, after)) <= BOUND["float32"][1]  # the packed copy holds the new weights
    assert _errors(sharp_model_dir, None, after)[0] > 1e-2  # and they really differ from the old ones


@needs_mkldnn
def test_a_repack_overtaken_by_an_update_is_dropped(sharp_model_dir, monkeypatch):
    """A re-pack built for update 1 that finishes after update 2 read (or may have read) old master values: it is
    never swapped in; the one for update 2 is."""
    monkeypatch.setattr(prec, "PACK_MIN_ELEMENTS", 0)
    eng = InferenceEngine(str(sharp_model_dir), max_batch=4, max_model_len=64)
    eng.start()
    try:
        w1, w2 = _new_weights(sharp_model_dir, seed=2), _new_weights(sharp_model_dir, seed=3)
        asyncio.run(eng.run_paused(lambda: eng.load_weights(w1, version=1)))
        _wait_repacked(eng.runner)  # update 1's packed weights wait for a step boundary ...
        asyncio.run(eng.run_paused(lambda: eng.load_weights(w2, version=2)))  # ... which comes after update 2
        # update 1's pack is never taken; update 2's may already be ready on a busy host (then it is the one taken,
        # and the logprobs below, checked against update 2's weights, tell a stale pack apart)
        installed = eng.runner.install_packed()
        assert all(_packed(eng.runner)) if installed else not any(_packed(eng.runner))
        _wait_repacked(eng.runner)
        res = asyncio.run(_generate(eng, temperature=1.0))
        assert all(_packed(eng.runner))
    finally:
        eng.stop()
    assert max(_errors(sharp_model_dir, w2, res)) <= BOUND["float32"][1]


def test_packing_stays_off_where_it_cannot_run(sharp_model_dir, monkeypatch):
    monkeypatch.setattr(prec, "PACK_MIN_ELEMENTS", 0)
    for precision in ("bfloat16", "int8"):  # not float32: never packed by oneDNN here
        eng = InferenceEngine(str(sharp_model_dir), max_batch=2, max_model_len=32, generator_precision=precision)
        assert not any(_packed(eng.runner))
    monkeypatch.setenv("INFLIGHT_PACK_WEIGHTS", "0")  # switched off by the user
    assert not any(_packed(InferenceEngine(str(sharp_model_dir), max_batch=2, max_model_len=32).runner))
    monkeypatch.delenv("INFLIGHT_PACK_WEIGHTS")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # a torch without oneDNN
    assert not prec.packing_available("cpu") and not prec.packing_available("meta")
    eng = InferenceEngine(str(sharp_model_dir), max_batch=2, max_model_len=32)
    assert not any(_packed(eng.runner))
    eng.start()
    try:
        res = asyncio.run(_generate(eng, temperature=1.0))
    finally:
        eng.stop()
    assert max(_errors(sharp_model_dir, None, res)) <= BOUND["float32"][1]


def test_threshold_packs_only_large_matrices(sharp_model_dir):
    w = torch.zeros(prec.PACK_MIN_ELEMENTS // 64, 64)
    assert isinstance(prec._pack_large(w, None)[0], prec.PackedLinear) == prec.packing_available("cpu")
    small = torch.zeros(w.shape[0] - 1, 64)
    assert prec._pack_large(small, None)[0] is small
