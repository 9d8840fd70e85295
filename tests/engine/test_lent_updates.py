"""Lent shared-memory updates (ShmWriter(lend=True)): the trainer writes two segments in turn and promises to leave
each alone until the next update is answered, but it keeps them writable, so the built-in engine copies a lent
segment like any other (once, checked as it copies) and never computes from it: rewriting a segment after its update
was answered changes nothing served. A real engine, a real WeightReceiver and real segments; exact comparisons of the
weights, where the engine's storage lies, and the engine's logprobs against a float64 HF forward."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inflight.engine.core import InferenceEngine
from inflight.engine.weight_receiver import WeightReceiver, WeightUpdateError
from inflight.shm_weights import ShmWriter
from tests.engine.test_precision import BOUND, _errors, _generate, _new_weights, sharp_model_dir  # noqa: F401
from tests.engine.test_staged_updates import Overlap, _begin, model_equals, perturbed, shm_push

torch.set_num_threads(1)


@pytest.fixture()
def engine(tied_model_dir, tmp_path):
    eng = InferenceEngine(str(tied_model_dir), max_batch=2, max_model_len=64)
    writer = ShmWriter(str(tmp_path), lend=True)
    eng.start()
    yield eng, WeightReceiver(eng), writer
    eng.stop()
    writer.discard()


def in_segment(eng: InferenceEngine, receiver: WeightReceiver, path: str) -> dict:
    """{block: whether the engine computes it from the server's mapping of the segment at `path`}."""
    (whole,) = [t for key, t in receiver._shm._maps.items() if key[0] == path]
    lo, hi = whole.data_ptr(), whole.data_ptr() + whole.numel()
    out = {}
    for where in eng.runner.members:
        t = eng.runner._storage(where)
        out[where] = lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
    return out


def test_a_lent_segment_is_copied_and_a_rewrite_after_the_answer_changes_nothing(engine):
    eng, receiver, writer = engine
    w1 = perturbed(eng, seed=1)
    shm_push(receiver, writer, w1, version=1)
    first = writer.path
    assert eng.version == 1 and model_equals(eng, w1)
    assert not any(in_segment(eng, receiver, first).values())  # every block in storage of the engine's own
    assert receiver.last_update["staged"] == len(eng.runner.members)
    writer._cur.data.view(torch.float32).fill_(float("nan"))  # the trainer breaks its promise: nothing follows
    assert model_equals(eng, w1)
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight  # the tied head follows the embedding

    w2 = perturbed(eng, seed=2)
    shm_push(receiver, writer, w2, version=2)  # the other segment of the pair
    assert writer.path != first and model_equals(eng, w2)
    assert not any(in_segment(eng, receiver, writer.path).values())


@pytest.mark.parametrize("where", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                   "model.norm.weight"])  # staged, staged (in a fused block), copied before the pause
def test_a_nonfinite_lent_update_is_refused_and_changes_nothing(engine, where):
    eng, receiver, writer = engine
    w1 = perturbed(eng, seed=4)
    shm_push(receiver, writer, w1, version=1)
    poisoned = perturbed(eng, seed=5)
    poisoned[where].view(-1)[5] = float("nan")
    with pytest.raises(WeightUpdateError, match=rf"NaN or Inf values in \['{where}'\]"):
        shm_push(receiver, writer, poisoned, version=2)
    assert eng.version == 1 and model_equals(eng, w1)
    writer.discard()  # what the trainer does after a failed update: new files
    w3 = perturbed(eng, seed=6)
    shm_push(receiver, writer, w3, version=3)
    assert eng.version == 3 and model_equals(eng, w3)


def test_a_lent_update_followed_while_written_is_exact(engine, monkeypatch):
    """The server copies and checks each part of a lent segment as the trainer writes it. The segment is new, so the
    bytes ahead of the trainer are zeros until written."""
    eng, receiver, writer = engine
    overlap = Overlap(monkeypatch)
    w1 = perturbed(eng, seed=10)
    req, offsets = _begin(writer, w1, 1)
    th = overlap.write(writer, w1, offsets)
    asyncio.run(receiver.update(req))
    th.join()
    overlap.check()
    assert eng.version == 1 and model_equals(eng, w1)
    assert not any(in_segment(eng, receiver, writer.path).values())


def test_lent_updates_generate_with_the_new_weights(sharp_model_dir, tmp_path):
    """Logprobs after lent updates (the first pushed while a generation runs, then one into each segment) match a
    float64 forward of the pushed weights."""
    eng = InferenceEngine(str(sharp_model_dir), max_batch=4, max_model_len=64)
    receiver, writer = WeightReceiver(eng), ShmWriter(str(tmp_path), lend=True)
    eng.start()
    try:
        ws = [_new_weights(sharp_model_dir, seed=s) for s in (1, 2, 3)]

        async def during_generation():
            gen = asyncio.ensure_future(_generate(eng, temperature=1.0))
            await asyncio.to_thread(shm_push, receiver, writer, ws[0], 1)
            await gen

        asyncio.run(during_generation())
        after = [asyncio.run(_generate(eng, temperature=1.0))]
        for v in (2, 3):
            shm_push(receiver, writer, ws[v - 1], version=v)
            after.append(asyncio.run(_generate(eng, temperature=1.0)))
    finally:
        eng.stop()
        writer.discard()
    for w, a in zip(ws, after):
        assert max(_errors(sharp_model_dir, w, a)) <= BOUND["float32"][1]
