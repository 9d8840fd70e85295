"""Lent shared-memory updates (ShmWriter(lend=True), LlamaRunner.stage with `lend`): the trainer writes two segments
in turn and the built-in engine computes straight from the one of the last update, so a push costs one copy. A real
engine, a real WeightReceiver and real segments; exact comparisons of the weights, where the engine's storage lies,
and the engine's logprobs against a float64 HF forward."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save_file

from inflight.contracts import WeightUpdateRequest
from inflight.engine.core import InferenceEngine
from inflight.engine.weight_receiver import WeightReceiver, WeightUpdateError
from inflight.shm_weights import ShmWriter
from tests.engine.test_precision import BOUND, _errors, _generate, _new_weights, sharp_model_dir  # noqa: F401
from tests.engine.test_staged_updates import Overlap, _begin, model_equals, perturbed, shm_push
from tests.test_lora_push import Q0

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


def test_the_engine_computes_from_the_segment_of_the_last_update(engine):
    eng, receiver, writer = engine
    runner = eng.runner
    w1 = perturbed(eng, seed=1)
    shm_push(receiver, writer, w1, version=1)
    first = writer.path
    assert eng.version == 1 and model_equals(eng, w1)
    assert receiver.last_update["lent"] == len(runner.members)  # every block: the tiny model pads nothing
    assert all(in_segment(eng, receiver, first).values())
    assert not runner._spares  # nothing copied, no spare kept
    L = runner.layers[0]  # the fused matrices the forward reads are views of q|k|v and gate|up in the segment
    assert torch.equal(L["w_qkv"], torch.cat([w1[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv"]))
    assert torch.equal(L["w_gu"], torch.cat([w1[f"model.layers.0.mlp.{m}_proj.weight"] for m in ("gate", "up")]))
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight  # the tied head follows the embedding

    w2 = perturbed(eng, seed=2)
    shm_push(receiver, writer, w2, version=2)
    second = writer.path
    assert second != first and model_equals(eng, w2)
    assert all(in_segment(eng, receiver, second).values()) and not any(in_segment(eng, receiver, first).values())
    writer._segments[0].data.fill_(7)  # the trainer may write the first segment now: the engine left it
    assert model_equals(eng, w2)

    w3 = perturbed(eng, seed=3)
    shm_push(receiver, writer, w3, version=3)
    assert writer.path == first and model_equals(eng, w3) and all(in_segment(eng, receiver, first).values())


@pytest.mark.parametrize("where", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                   "model.norm.weight"])  # lent, lent (in a fused block), copied in the pause
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


def test_an_update_copied_in_place_after_a_lent_one_leaves_the_segment_alone(engine, tmp_path):
    """A file update (copied into the model in the pause) after a lent one: the engine first takes the blocks it
    writes into storage of its own; the segment's bytes do not change (it is mapped read-only: a write would crash)."""
    eng, receiver, writer = engine
    w1 = perturbed(eng, seed=7)
    shm_push(receiver, writer, w1, version=1)
    segment = writer._segments[0].data.clone()
    partial = {Q0: w1[Q0] + 1.0}
    save_file(partial, str(tmp_path / "q.safetensors"))
    asyncio.run(receiver.update(WeightUpdateRequest(version=2, path=str(tmp_path / "q.safetensors"))))
    assert eng.version == 2 and model_equals(eng, {**w1, **partial})
    assert torch.equal(writer._segments[0].data, segment)
    lent = in_segment(eng, receiver, writer.path)
    assert not lent[(0, "w_qkv")] and sum(lent.values()) == len(lent) - 1  # only the written block was taken
    w3 = perturbed(eng, seed=8)
    shm_push(receiver, writer, w3, version=3)  # and lending goes on
    assert model_equals(eng, w3) and all(in_segment(eng, receiver, writer.path).values())


def test_a_block_whose_members_are_not_back_to_back_is_copied(engine):
    eng, receiver, writer = engine
    w1 = perturbed(eng, seed=9)
    k0 = "model.layers.0.self_attn.k_proj.weight"
    reordered = {k0: w1[k0], **{n: t for n, t in w1.items() if n != k0}}  # k before q: layer 0's q|k|v is split
    shm_push(receiver, writer, reordered, version=1)
    assert eng.version == 1 and model_equals(eng, w1)
    lent = in_segment(eng, receiver, writer.path)
    assert not lent[(0, "w_qkv")] and sum(lent.values()) == len(lent) - 1
    assert receiver.last_update["lent"] == len(lent) - 1


def test_a_lent_update_followed_while_written_is_exact(engine, monkeypatch):
    """The server checks each part of a lent segment as the trainer writes it, and computes from it once complete.
    The segment is new, so the bytes ahead of the trainer are zeros until written."""
    eng, receiver, writer = engine
    overlap = Overlap(monkeypatch)
    w1 = perturbed(eng, seed=10)
    req, offsets = _begin(writer, w1, 1)
    th = overlap.write(writer, w1, offsets)
    asyncio.run(receiver.update(req))
    th.join()
    overlap.check()
    assert eng.version == 1 and model_equals(eng, w1) and receiver.last_update["lent"] == len(eng.runner.members)


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
            assert receiver.last_update["lent"] > 0
            after.append(asyncio.run(_generate(eng, temperature=1.0)))
    finally:
        eng.stop()
        writer.discard()
    for w, a in zip(ws, after):
        assert max(_errors(sharp_model_dir, w, a)) <= BOUND["float32"][1]
    assert _errors(sharp_model_dir, ws[0], after[2])[0] > 1e-2  # the updates really differ
