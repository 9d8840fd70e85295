"""The `sglang` weight protocol against fake SGLang servers (SGLang itself cannot run here: its CPU backend needs
AMX). The fakes (own processes) validate the documented schemas, really join the gloo group the way SGLang's workers
do, and receive the tensors."""

from __future__ import annotations

import httpx
import pytest
import torch

from inflight.trainer.weight_sync.common import WeightSyncError
from inflight.trainer.weight_sync.sglang import SGLangWeightSync
from tests.protocols.fake_sglang import FakeProcess


@pytest.fixture(scope="module")
def fakes():
    made = [FakeProcess(), FakeProcess()]
    yield made
    for f in made:
        f.stop()


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("model.embed_tokens.weight", torch.randn(11, 8, generator=g)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8, generator=g)),
            ("lm_head.weight", torch.randn(11, 8, generator=g))]


def calls_since(fake: FakeProcess, n: int) -> list:
    return fake.state()["calls"][n:]


def assert_received(update: list[dict], sent: list[tuple[str, torch.Tensor]], dtype=torch.float32) -> None:
    assert [u["name"] for u in update] == [n for n, _ in sent]  # in order
    for u, (_, t) in zip(update, sent):
        want = t.to(dtype).double().flatten()
        assert torch.equal(torch.tensor(u["values"], dtype=torch.float64), want)


def test_push_reaches_every_server_in_order(fakes):
    before = [len(f.state()["calls"]) for f in fakes]
    nrecv = [len(f.state()["received"]) for f in fakes]
    client = SGLangWeightSync([f.url for f in fakes], timeout_s=30)
    try:
        client.init_process_group()
        assert client.world_size == 3
        sent = weights(1)
        stats = client.push(sent, version=1)
        assert stats["num_tensors"] == 3 and stats["bytes"] == sum(t.numel() * 4 for _, t in sent)
        sent2 = [(n, t * 2 + 1) for n, t in weights(2)]
        client.push(sent2, version=2, mode="interrupt")
    finally:
        client.close()
    offsets = []
    for f, b, r in zip(fakes, before, nrecv):
        st = f.state()
        calls = st["calls"][b:]
        assert [c[0] for c in calls] == ["init", "pause", "update", "continue", "pause", "update", "continue",
                                         "destroy"]
        init, upd1, upd2 = calls[0][1], calls[2][1], calls[5][1]
        offsets.append(init["rank_offset"])
        assert (init["world_size"], init["backend"], init["group_name"]) == (3, "gloo", "weight_update_group")
        assert calls[1][1]["mode"] == "in_place" and calls[4][1]["mode"] == "retract"
        assert upd1["names"] == [n for n, _ in sent] and upd1["dtypes"] == ["float32"] * 3
        assert upd1["shapes"] == [[11, 8], [16, 8], [11, 8]]
        assert (upd1["weight_version"], upd1["flush_cache"]) == ("1", False)
        assert (upd2["weight_version"], upd2["flush_cache"]) == ("2", True)
        assert_received(st["received"][r], sent)
        assert_received(st["received"][r + 1], sent2)
        assert st["paused"] is None
    assert sorted(offsets) == [1, 2]


def test_dtype_conversion_bf16(fakes):
    fake = fakes[0]
    r = len(fake.state()["received"])
    client = SGLangWeightSync([fake.url], timeout_s=30, dtype="bfloat16")
    try:
        client.init_process_group()
        sent = weights(3)
        client.push(sent, version=7)
    finally:
        client.close()
    got = fake.state()["received"][r]
    assert [u["dtype"] for u in got] == ["bfloat16"] * 3
    assert_received(got, sent, dtype=torch.bfloat16)


def test_fake_catches_invalid_use(fakes):
    url = fakes[1].url
    body = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "weight_update_group"}
    r = httpx.post(url + "/update_weights_from_distributed", json=body)  # before any group
    assert r.status_code == 400 and "no weight update group" in r.json()["message"]
    assert httpx.post(url + "/continue_generation", json={}).status_code == 400  # not paused
    r = httpx.post(url + "/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": 1})
    assert r.status_code == 422  # rank_offset, world_size missing
    assert httpx.post(url + "/pause_generation", json={"mode": "sideways"}).status_code == 422
    assert httpx.post(url + "/update_weights_from_distributed", json={**body, "nmaes": []}).status_code == 422


def test_client_reports_server_refusal(fakes):
    fake = fakes[0]
    r = len(fake.state()["received"])
    client = SGLangWeightSync([fake.url], timeout_s=30)
    try:
        with pytest.raises(WeightSyncError, match="init_process_group"):
            client.push(weights(1), version=1)  # no group yet: refused before anything is sent
        client.init_process_group()
        httpx.post(fake.url + "/_set_paused", json={"mode": "in_place"})  # someone else paused it
        with pytest.raises(WeightSyncError, match="already paused"):
            client.push(weights(1), version=1)
        assert len(fake.state()["received"]) == r
    finally:
        client.close()
    httpx.post(fake.url + "/continue_generation", json={})


def test_nccl_backend_refused_by_gloo_fake(fakes):
    client = SGLangWeightSync([fakes[0].url], timeout_s=5, backend="nccl")
    try:
        with pytest.raises(WeightSyncError, match="gloo groups only"):
            client.init_process_group()
    finally:
        client.close()


def test_a_tied_tensor_is_sent_once(fakes):
    """A state_dict-style list naming the embedding twice (lm_head.weight of a tied model): one name, one broadcast."""
    fake = fakes[1]
    r = len(fake.state()["received"])
    sent = weights(4)[:2]
    client = SGLangWeightSync([fake.url], timeout_s=30)
    try:
        client.init_process_group()
        stats = client.push([*sent, ("lm_head.weight", sent[0][1])], version=9)
    finally:
        client.close()
    assert stats["num_tensors"] == 2
    assert_received(fake.state()["received"][r], sent)
