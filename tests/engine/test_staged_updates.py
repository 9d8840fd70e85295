"""Staged shared-memory updates on the built-in llama path (LlamaRunner.stage): the update is copied into the
runner's spare storage while the engine runs and the pause only re-points the model at it. A real engine, a real
WeightReceiver and a real segment written by the trainer's ShmWriter; exact comparisons of the weights, and the
engine's logprobs against a float64 HF forward (tests/engine/test_precision.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from inflight.engine.core import InferenceEngine
from inflight.engine.weights.receiver import WeightReceiver, WeightUpdateError
from inflight.transport.finite import copy_summed, finite_sums
from inflight.transport.layout import shm_layout
from inflight.transport.schemas import ParamInfo, WeightUpdateRequest
from inflight.transport.shm import WRITING, SegmentWatch, ShmWriter, announcement_digest
from tests.engine.test_precision import BOUND, _errors, _generate, _new_weights, sharp_model_dir  # noqa: F401
from tests.test_lora_push import Q0, make_adapter

torch.set_num_threads(1)


def shm_push(receiver: WeightReceiver, writer: ShmWriter, weights: dict[str, torch.Tensor], version: int) -> dict:
    """What WeightSyncClient does for transport=shm, minus HTTP: write the segment, hand its announcement over."""
    params = [ParamInfo(name=n, shape=list(t.shape), dtype="float32") for n, t in weights.items()]
    offsets, data_bytes = shm_layout(params)
    seg = writer.write(list(weights.items()), ["float32"] * len(params), offsets, data_bytes, version,
                       announcement_digest(params))
    return asyncio.run(receiver.update(WeightUpdateRequest(version=version, params=params, shm=seg)))


def perturbed(eng: InferenceEngine, seed: int) -> dict[str, torch.Tensor]:
    """New values for every parameter the update carries (a tied alias travels under its canonical name)."""
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in eng.model.named_parameters()
            if n not in eng.tied_aliases}


def model_equals(eng: InferenceEngine, weights: dict[str, torch.Tensor]) -> bool:
    params = dict(eng.model.named_parameters())
    return all(torch.equal(params[n], t) for n, t in weights.items())


def storage(eng: InferenceEngine) -> dict:
    return {where: eng.runner._storage(where).data_ptr() for where in eng.runner.members}


@pytest.fixture()
def engine(tied_model_dir, tmp_path):
    eng = InferenceEngine(str(tied_model_dir), max_batch=2, max_model_len=64)
    writer = ShmWriter(str(tmp_path))
    eng.start()
    yield eng, WeightReceiver(eng), writer
    eng.stop()
    writer.discard()


def test_staged_updates_are_exact_and_reuse_the_spare_storage(engine):
    eng, receiver, writer = engine
    runner = eng.runner
    assert runner.double_buffer and (-1, "embed") in runner.members and (-1, "head") not in runner.members  # tied
    at_start = storage(eng)
    w1 = perturbed(eng, seed=1)
    shm_push(receiver, writer, w1, version=1)
    assert eng.version == 1 and model_equals(eng, w1)
    assert "staged" in receiver.last_update and receiver.last_update["staged"] == len(runner.members)
    first = storage(eng)
    assert all(first[w] != at_start[w] for w in first)  # every block was swapped, none copied in the pause
    L = runner.layers[0]  # the fused matrices the forward reads hold the new q|k|v and gate|up
    assert torch.equal(L["w_qkv"], torch.cat([w1[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv"]))
    assert torch.equal(L["w_gu"], torch.cat([w1[f"model.layers.0.mlp.{m}_proj.weight"] for m in ("gate", "up")]))
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight  # the tied head follows the embedding
    w2 = perturbed(eng, seed=2)
    shm_push(receiver, writer, w2, version=2)
    assert eng.version == 2 and model_equals(eng, w2)
    assert storage(eng) == at_start  # the second update went into the storage the first one let go: no new memory
    # the model holds its own copy: writing the segment again (no update announced) changes nothing
    params = [ParamInfo(name=n, shape=list(t.shape), dtype="float32") for n, t in w1.items()]
    offsets, data_bytes = shm_layout(params)
    writer.write(list(w1.items()), ["float32"] * len(params), offsets, data_bytes, 3, announcement_digest(params))
    assert model_equals(eng, w2)


@pytest.mark.parametrize("kernel", [True, False])  # the C copy-and-count, or torch chunks summed while copied
@pytest.mark.parametrize("where", ["model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight",
                                   "model.layers.0.input_layernorm.weight",  # staged, staged, copied in the pause
                                   "model.norm.weight"])  # the last tensor written
def test_a_nonfinite_staged_update_is_refused_and_changes_nothing(engine, where, kernel):
    eng, receiver, writer = engine
    if kernel and eng.runner._copier is None:
        pytest.skip("no C compiler: the C kernels are not built")
    if not kernel:
        eng.runner._copier = None
    w1 = perturbed(eng, seed=3)
    shm_push(receiver, writer, w1, version=1)
    for v, bad in ((2, float("nan")), (3, float("inf"))):
        poisoned = perturbed(eng, seed=4)
        poisoned[where].view(-1)[5] = bad
        with pytest.raises(WeightUpdateError, match=rf"NaN or Inf values in \['{where}'\]"):
            shm_push(receiver, writer, poisoned, version=v)  # the same segment, reused
        assert eng.version == 1 and model_equals(eng, w1)
    w4 = perturbed(eng, seed=5)  # the spares a refused update wrote into are fully written again
    shm_push(receiver, writer, w4, version=4)
    assert eng.version == 4 and model_equals(eng, w4)


def _begin(writer: ShmWriter, weights: dict[str, torch.Tensor], version: int):
    params = [ParamInfo(name=n, shape=list(t.shape), dtype="float32") for n, t in weights.items()]
    offsets, data_bytes = shm_layout(params)
    seg = writer.begin(data_bytes, version, announcement_digest(params))
    return WeightUpdateRequest(version=version, params=params, shm=seg), offsets


def _write_slowly(writer: ShmWriter, weights: dict[str, torch.Tensor], offsets: list[int], upto: int,
                  then=None) -> threading.Thread:
    """The trainer's side, one tensor every 5 ms (the first `upto`), then `then()` (finish, abandon or nothing)."""
    items = list(weights.items())

    def run():
        for i in range(upto):
            time.sleep(0.005)
            writer.write_tensors([items[i]], ["float32"], [offsets[i]])
        if then is not None:
            then()

    th = threading.Thread(target=run)
    th.start()
    return th


class Overlap:
    """Both sides of a segment followed while written, without timing: the trainer writes the first half of the
    tensors and is held there until the server has taken two parts of the segment (SegmentWatch.ready returned
    while the state was WRITING: the first part was read before the second was asked for), then writes the rest
    and finishes. `reads`: (end of the part, bytes written, state) as each ready() returned."""

    HOLD_S = 60  # only for a server that never reads ahead of completion: the test then fails

    def __init__(self, monkeypatch):
        self.reads: list[tuple[int, int, int]] = []
        self.taken = threading.Event()
        self.held_until_read: bool | None = None
        self.half_bytes = 0
        real = SegmentWatch.ready

        def ready(watch: SegmentWatch, view: torch.Tensor) -> None:
            real(watch, view)
            end = view.data_ptr() - watch._data_addr + view.numel() * view.element_size()
            self.reads.append((end, watch._written.value, watch._state.value))
            if sum(1 for r in self.reads if r[2] == WRITING) >= 2:
                self.taken.set()

        monkeypatch.setattr(SegmentWatch, "ready", ready)

    def write(self, writer: ShmWriter, weights: dict[str, torch.Tensor], offsets: list[int]) -> threading.Thread:
        items, half = list(weights.items()), len(weights) // 2
        self.half_bytes = offsets[half]

        def run():
            writer.write_tensors(items[:half], ["float32"] * half, offsets[:half])
            self.held_until_read = self.taken.wait(self.HOLD_S)
            writer.write_tensors(items[half:], ["float32"] * (len(items) - half), offsets[half:])
            writer.finish()

        th = threading.Thread(target=run)
        th.start()
        return th

    def check(self) -> None:
        """The server read parts of the segment while the trainer was held halfway, and only what was written."""
        assert self.held_until_read is True, f"the server read nothing of the segment before it was complete: " \
                                             f"{self.reads[:4]}"
        first = self.reads[:2]
        assert all(state == WRITING and end <= written <= self.half_bytes for end, written, state in first), first
        assert all(end <= written for end, written, state in self.reads if state == WRITING)


def test_an_overlapped_update_is_exact(engine, monkeypatch):
    """The server copies each tensor as soon as the trainer has written it: it follows the segment while its state
    is WRITING. The segment is reused, so the bytes ahead of the trainer still hold the previous version: a server
    that read ahead would serve some of them."""
    eng, receiver, writer = engine
    w1 = perturbed(eng, seed=11)
    shm_push(receiver, writer, w1, version=1)
    overlap = Overlap(monkeypatch)
    w2 = perturbed(eng, seed=12)
    req, offsets = _begin(writer, w2, 2)
    th = overlap.write(writer, w2, offsets)
    asyncio.run(receiver.update(req))
    th.join()
    overlap.check()
    assert eng.version == 2 and model_equals(eng, w2)
    assert receiver.last_update["staged"] == len(eng.runner.members)


@pytest.mark.parametrize("how", ["stops", "abandons"])
def test_a_trainer_that_fails_midway_changes_nothing_in_process(engine, monkeypatch, how):
    eng, receiver, writer = engine
    monkeypatch.setenv("INFLIGHT_SHM_STALL_S", "0.3")
    w1 = perturbed(eng, seed=13)
    shm_push(receiver, writer, w1, version=1)
    w2 = perturbed(eng, seed=14)
    req, offsets = _begin(writer, w2, 2)
    th = _write_slowly(writer, w2, offsets, len(w2) // 2, writer.abandon if how == "abandons" else None)
    match = "abandoned by the trainer" if how == "abandons" else r"stopped writing .* no progress for 0.3s"
    with pytest.raises(WeightUpdateError, match=match) as e:
        asyncio.run(receiver.update(req))
    th.join()
    assert e.value.status == 409 and "nothing applied, weights stay at v1" in str(e.value)
    assert eng.version == 1 and model_equals(eng, w1)
    writer.discard()  # a failed update: the next one is written to a new segment
    shm_push(receiver, writer, w2, version=3)
    assert eng.version == 3 and model_equals(eng, w2)


def test_a_partial_update_keeps_the_other_members_of_a_fused_block(engine):
    eng, receiver, writer = engine
    w1 = perturbed(eng, seed=6)
    shm_push(receiver, writer, w1, version=1)
    new_q = {Q0: w1[Q0] + 1.0}
    shm_push(receiver, writer, new_q, version=2)
    assert model_equals(eng, {**w1, **new_q})
    assert torch.equal(eng.runner.layers[0]["w_qkv"], torch.cat(
        [new_q[Q0]] + [w1[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "kv"]))


def test_a_full_update_after_an_adapter_reverts_what_it_leaves_out(engine, tmp_path):
    """An adapted base that the staged full update does not list goes back to W0 (copied in the pause, into the
    block's new storage); the adapted block's other members take the update."""
    eng, receiver, writer = engine
    w0 = perturbed(eng, seed=7)
    shm_push(receiver, writer, w0, version=1)
    adapter = make_adapter(w0, [Q0], rank=2, seed=8)
    save_file(adapter, str(tmp_path / "a.safetensors"))
    asyncio.run(receiver.update(WeightUpdateRequest(version=2, path=str(tmp_path / "a.safetensors"),
                                                    adapter={"rank": 2, "scaling": 1.0})))
    assert not model_equals(eng, {Q0: w0[Q0]})
    full = {n: t for n, t in perturbed(eng, seed=9).items() if n != Q0}
    shm_push(receiver, writer, full, version=3)
    assert model_equals(eng, {**full, Q0: w0[Q0]})


def in_segment(eng: InferenceEngine, receiver: WeightReceiver, path: str) -> dict:
    """{block: whether the engine computes it from the server's mapping of the segment at `path`}."""
    (whole,) = [t for key, t in receiver._shm._maps.items() if key[0] == path]
    lo, hi = whole.data_ptr(), whole.data_ptr() + whole.numel()
    out = {}
    for where in eng.runner.members:
        t = eng.runner._storage(where)
        out[where] = lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
    return out


def test_a_segment_is_copied_and_a_rewrite_after_the_answer_changes_nothing(engine):
    eng, receiver, writer = engine
    w1 = perturbed(eng, seed=1)
    shm_push(receiver, writer, w1, version=1)
    first = writer.path
    assert eng.version == 1 and model_equals(eng, w1)
    assert not any(in_segment(eng, receiver, first).values())  # every block in storage of the engine's own
    assert receiver.last_update["staged"] == len(eng.runner.members)
    writer._cur.data.view(torch.float32).fill_(float("nan"))  # the trainer writes its segment again: nothing follows
    assert model_equals(eng, w1)
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight  # the tied head follows the embedding

    # the same segment again, announced with a `lend` promise (which a server cannot check): copied all the same
    w2 = perturbed(eng, seed=2)
    params = [ParamInfo(name=n, shape=list(t.shape), dtype="float32") for n, t in w2.items()]
    offsets, data_bytes = shm_layout(params)
    seg = writer.write(list(w2.items()), ["float32"] * len(params), offsets, data_bytes, 2,
                       announcement_digest(params))
    asyncio.run(receiver.update(WeightUpdateRequest(version=2, params=params, shm={**seg, "lend": True})))
    assert writer.path == first and model_equals(eng, w2)
    assert not any(in_segment(eng, receiver, first).values())
    writer._cur.data.view(torch.float32).fill_(float("nan"))
    assert model_equals(eng, w2)


def test_staged_updates_generate_with_the_new_weights(sharp_model_dir, tmp_path):
    """Logprobs after a staged update (and after the next one, into the reused storage) match a float64 forward
    of the pushed weights; the first update is pushed while a generation runs."""
    eng = InferenceEngine(str(sharp_model_dir), max_batch=4, max_model_len=64)
    receiver, writer = WeightReceiver(eng), ShmWriter(str(tmp_path))
    eng.start()
    try:
        w1, w2 = _new_weights(sharp_model_dir, seed=1), _new_weights(sharp_model_dir, seed=2)

        async def during_generation():
            gen = asyncio.ensure_future(_generate(eng, temperature=1.0))
            await asyncio.to_thread(shm_push, receiver, writer, w1, 1)
            await gen

        asyncio.run(during_generation())
        after1 = asyncio.run(_generate(eng, temperature=1.0))
        shm_push(receiver, writer, w2, version=2)
        after2 = asyncio.run(_generate(eng, temperature=1.0))
    finally:
        eng.stop()
        writer.discard()
    assert max(_errors(sharp_model_dir, w1, after1)) <= BOUND["float32"][1]
    assert max(_errors(sharp_model_dir, w2, after2)) <= BOUND["float32"][1]
    assert _errors(sharp_model_dir, w1, after2)[0] > 1e-2  # the two updates really differ


def test_copy_summed_is_a_copy_and_a_finite_check():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(3 * (1 << 17) + 7, generator=g)  # several chunks and a short last one
    dst, sums = torch.empty_like(src), []
    copy_summed(dst, src, sums)
    assert torch.equal(dst, src) and len(sums) > 1 and finite_sums(sums)
    assert abs(torch.stack(sums).double().sum().item() - src.double().sum().item()) < 1e-2
    for bad in (float("nan"), float("inf"), float("-inf")):
        src2 = src.clone()
        src2[-1] = bad  # in the last, short chunk
        sums = []
        copy_summed(dst, src2, sums)
        assert not finite_sums(sums)
    assert finite_sums([])
