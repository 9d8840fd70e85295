"""Parts of the vLLM backend that need no vLLM: checkpoint specs from safetensors headers, validation of an
announced update (400 before anything is received), version spans, argument handling. Run in `make test`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from inflight.engine.serve import strip_engine_flag
from inflight.engine.vllm_backend.engine import _at, _logprob_of
from inflight.engine.vllm_backend.launcher import check_vllm_version
from inflight.engine.vllm_backend.receiver import VLLMWeightReceiver, checkpoint_specs, safetensors_header
from inflight.engine.weights.receiver import WeightUpdateError
from inflight.transport.schemas import WeightUpdateRequest


@pytest.fixture()
def receiver(tmp_path):
    save_file({"a.weight": torch.zeros(3, 4), "b.bias": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    specs = checkpoint_specs(str(tmp_path), "float32")
    assert specs == {"a.weight": ((3, 4), torch.float32), "b.bias": ((5,), torch.float32)}
    return VLLMWeightReceiver(SimpleNamespace(llm=None, version=0), specs, device="cpu")


def test_header_is_read_without_tensors(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"w": torch.zeros(2, 7, dtype=torch.bfloat16)}, str(p))
    assert safetensors_header(str(p)) == {"w": ([2, 7], "bfloat16")}


def test_file_announcements_are_checked(receiver, tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"a.weight": torch.ones(3, 4)}, str(good))  # a subset is a valid partial update
    receiver.validate(WeightUpdateRequest(version=1, path=str(good)))
    cases = [({"a.weight": torch.ones(4, 3)}, "shape"), ({"zzz": torch.ones(1)}, "unknown"),
             ({"b.bias": torch.ones(5, dtype=torch.float16)}, "dtype")]
    for i, (tensors, word) in enumerate(cases):
        p = tmp_path / f"bad{i}.safetensors"
        save_file(tensors, str(p))
        with pytest.raises(WeightUpdateError, match=word) as e:
            receiver.validate(WeightUpdateRequest(version=1, path=str(p)))
        assert e.value.status == 400
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(WeightUpdateError, match="not a readable"):
        receiver.validate(WeightUpdateRequest(version=1, path=str(tmp_path / "junk.safetensors")))
    with pytest.raises(WeightUpdateError, match="absolute"):
        receiver.validate(WeightUpdateRequest(version=1, path="rel.safetensors"))


def test_broadcast_announcements_are_checked(receiver):
    req = WeightUpdateRequest(version=1, params=[{"name": "a.weight", "shape": [3, 4], "dtype": "float32"}])
    with pytest.raises(WeightUpdateError) as e:
        receiver.validate(req)
    assert e.value.status == 409  # no process group yet
    receiver.has_group = True
    receiver.validate(req)
    bad = WeightUpdateRequest(version=1, params=[{"name": "a.weight", "shape": [3, 4], "dtype": "bfloat16"},
                                                 {"name": "c", "shape": [1], "dtype": "float32"}])
    with pytest.raises(WeightUpdateError, match=r"dtype.*unknown tensor 'c'"):
        receiver.validate(bad)


def test_a_tied_models_head_is_not_a_parameter(tmp_path):
    """tie_word_embeddings: the head is the embedding, announced once as model.embed_tokens.weight; a checkpoint
    that stores a copy of lm_head.weight does not make the alias updatable."""
    save_file({"model.embed_tokens.weight": torch.zeros(6, 4), "lm_head.weight": torch.zeros(6, 4)},
              str(tmp_path / "model.safetensors"))
    assert set(checkpoint_specs(str(tmp_path), "float32", tied=True)) == {"model.embed_tokens.weight"}
    assert set(checkpoint_specs(str(tmp_path), "float32")) == {"model.embed_tokens.weight", "lm_head.weight"}


def test_shm_announcements_are_checked(receiver, tmp_path):
    """The shm transport needs no group; the segment's header must name this version of these tensors."""
    from inflight.transport.layout import shm_layout
    from inflight.transport.schemas import ParamInfo
    from inflight.transport.shm import ShmWriter, announcement_digest

    params = [{"name": "a.weight", "shape": [3, 4], "dtype": "float32"}]
    infos = [ParamInfo(**p) for p in params]
    offsets, data = shm_layout(infos)
    w = ShmWriter(str(tmp_path))
    seg = w.write([("a.weight", torch.ones(3, 4))], ["float32"], offsets, data, 4, announcement_digest(infos))
    receiver.validate(WeightUpdateRequest(version=4, params=params, shm=seg))
    for req, word in [(dict(version=5, params=params, shm=seg), "announces 5"),
                      (dict(version=4, params=[{**params[0], "name": "zzz"}], shm=seg), "unknown"),
                      (dict(version=4, params=params, shm={**seg, "path": str(tmp_path / "none")}), "one host")]:
        with pytest.raises(WeightUpdateError, match=word):
            receiver.validate(WeightUpdateRequest(**req))
    w.discard()


def test_version_of_each_token_from_spans():
    live = [(0, 3), (4, 5)]  # (start index, version)
    assert [_at(live, i, -1) for i in range(7)] == [3, 3, 3, 3, 5, 5, 5]
    final = [SimpleNamespace(version="default", start=0, end=2), SimpleNamespace(version="7", start=2, end=4)]
    assert [_at(final, i, -1) for i in range(4)] == [0, 0, 7, 7]
    assert _at(None, 0, 9) == 9


def test_logprob_of_sampled_token_and_tops():
    lp = {5: SimpleNamespace(logprob=-2.5, rank=4), 1: SimpleNamespace(logprob=-0.1, rank=1),
          2: SimpleNamespace(logprob=-1.0, rank=2)}
    assert _logprob_of(lp, 5, 2) == (-2.5, [(1, -0.1), (2, -1.0)])
    assert _logprob_of(lp, 5, 0) == (-2.5, None)


def test_arguments():
    assert strip_engine_flag(["--engine", "vllm", "--model", "d", "--engine=vllm", "-O0"]) == ["--model", "d", "-O0"]
    check_vllm_version("0.32.0+cpu")
    check_vllm_version("0.33.2")
    for bad in ("0.31.9", "0.34.0", "1.0.0"):
        with pytest.raises(SystemExit, match="not supported"):
            check_vllm_version(bad)


def test_ipc_updates_are_refused_by_the_vllm_backend(receiver):
    receiver.has_group = True  # not a broadcast either: the handle must not be taken for one
    req = WeightUpdateRequest(version=1, params=[{"name": "a.weight", "shape": [3, 4], "dtype": "float32"}],
                              ipc={"kind": "cpu", "bytes": 304, "path": "/dev/shm/x"})
    with pytest.raises(WeightUpdateError, match="cuda_ipc") as e:
        receiver.validate(req)
    assert e.value.status == 400


def test_versions_never_go_back(receiver, tmp_path):
    """The version rule of every transport (update_checks.check_version): older than served is a 409, the same
    version again is a retry."""
    good = tmp_path / "good.safetensors"
    save_file({"a.weight": torch.ones(3, 4)}, str(good))
    receiver.engine.version = 5
    for req in (WeightUpdateRequest(version=4, path=str(good)),
                WeightUpdateRequest(version=4, params=[{"name": "a.weight", "shape": [3, 4], "dtype": "float32"}])):
        with pytest.raises(WeightUpdateError, match="stale version") as e:
            receiver.validate(req)
        assert e.value.status == 409
    receiver.validate(WeightUpdateRequest(version=5, path=str(good)))
