"""A weight group the trainer replaces (rejoin) or drops (abort, close) is shut down and freed off the caller's
thread, and close() waits until it is gone: nothing is left for interpreter exit to free. The server is a real
`inflight serve`; the trainer's old group is kept busy with a broadcast the server never receives (as one left in
flight by an abandoned push), which holds a gloo group's destructor until the broadcast ends."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from inflight.trainer.weight_sync.inflight import WeightSyncClient
from inflight.trainer.weight_sync.rejoin import rejoin_weight_group
from tests.servers import model_of, serve_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_model(tiny_model_dir) as proc:
        yield proc


def broadcast_in_flight(client: WeightSyncClient) -> torch.distributed.Work:
    """A broadcast on the client's group that the server is not receiving: 64 MB, more than the socket buffers
    hold, so it stays pending until the server's end closes or the group times out."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    work = client.group.broadcast([torch.zeros(16 * 2**20)], opts)
    assert not work.is_completed()
    return work


def complete(url: str) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model_of(url), "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def release_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("weight-group-") and t.is_alive()]


def test_rejoin_frees_the_old_group_without_waiting_for_its_broadcast(server, hf_weights):
    """The old group goes on a helper thread: the rejoin asks the server to join the new group, the server drops its
    old end, and the old broadcast fails at once on the closed connection (not at the group timeout). A push on the
    new group lands."""
    client = WeightSyncClient([server.url], timeout_s=20)
    try:
        client.init_process_group()
        work = broadcast_in_flight(client)
        rejoin_weight_group(client, 60)
        with pytest.raises(RuntimeError) as failed:
            work.wait()
        assert "Timed out" not in str(failed.value)
        assert "closed" in str(failed.value).lower() or "reset" in str(failed.value).lower(), failed.value
        before = complete(server.url)
        assert set(before["token_versions"]) == {0}
        client.push({n: t * 1.5 for n, t in hf_weights.items()}.items(), version=3)
        after = complete(server.url)  # what the server serves: version 3, other weights
        assert set(after["token_versions"]) == {3}
        assert after["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]
    finally:
        client.close()
    assert release_threads() == []


def test_close_waits_until_an_aborted_group_is_freed(server, hf_weights):
    """abort_group() frees the group off its thread (its broadcast to a live server that is not receiving runs until
    the group timeout); close() returns only once that group is gone."""
    client = WeightSyncClient([server.url], timeout_s=15)
    client.init_process_group()
    work = broadcast_in_flight(client)
    client.abort_group()
    assert client.group is None
    client.close()
    assert release_threads() == []
    assert work.is_completed()  # the broadcast ended (timed out) before its group was freed
    with pytest.raises(RuntimeError):
        work.wait()


@pytest.fixture(scope="module")
def hf_weights(tiny_model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}
