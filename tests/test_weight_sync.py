"""The weight-update contract end to end: this test process is trainer rank 0 (WeightSyncClient, gloo), the server
is `inflight serve` in a subprocess. Server logprobs are compared with an independent transformers forward."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from inflight.trainer.weight_sync.common import WeightSyncError
from inflight.trainer.weight_sync.inflight import WeightSyncClient
from tests.servers import generation_across_update, model_of, serve_model

torch.set_num_threads(1)
MSG = [{"role": "user", "content": "3+4="}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # --no-prefix-reuse: `fingerprint` repeats one request and must be bit-reproducible; with prefix reuse the
    # repeat would run only its last prompt token (the same values up to float32 rounding)
    with serve_model(tiny_model_dir, "--no-prefix-reuse") as proc:
        yield proc


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sync(server):
    c = WeightSyncClient([server.url], timeout_s=60)
    c.init_process_group()
    yield c
    c.close()


def perturbed(hf, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in hf.named_parameters()}


def reference_logprobs(hf, weights: dict[str, torch.Tensor], ids: list[int], n_prompt: int, temp: float) -> list[float]:
    """log p(token_t | tokens_<t) at temperature `temp`, float64 softmax over a float32 HF forward."""
    hf.load_state_dict(weights, strict=True)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits / temp, dim=-1)
    return [lp[t - 1, ids[t]].item() for t in range(n_prompt, len(ids))]


def chat(url: str, **kw) -> dict:
    body = {"model": model_of(url), "messages": MSG, "max_tokens": 8, "logprobs": True, "ignore_eos": True, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def server_logprobs(choice: dict) -> list[float]:
    return [e["logprob"] for e in choice["logprobs"]["content"]]


def check_matches(hf, weights, choice: dict, temp: float) -> None:
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    ref = reference_logprobs(hf, weights, ids, len(choice["prompt_token_ids"]), temp)
    got = server_logprobs(choice)
    assert len(got) == len(ref) > 0
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4, (got, ref)


def fingerprint(url: str) -> tuple:
    ch = chat(url, seed=5, temperature=1.0, max_tokens=6, top_logprobs=5)
    return tuple(ch["token_ids"]), tuple(server_logprobs(ch)), httpx.get(url + "/health").json()["version"]


def test_broadcast_update_changes_logprobs_to_new_weights(server, hf, sync):
    original = {n: p.detach().clone() for n, p in hf.named_parameters()}
    before = chat(server.url, temperature=0.8)
    check_matches(hf, original, before, 0.8)  # before any update: the saved weights
    new = perturbed(hf, seed=1)
    stats = sync.push(new.items(), version=1)
    assert stats["bytes"] == sum(t.numel() * 4 for t in new.values()) and stats["pause_s"][server.url] >= 0
    after = chat(server.url, temperature=0.8)
    assert set(after["token_versions"]) == {1}
    check_matches(hf, new, after, 0.8)
    with pytest.raises(AssertionError):  # the old weights no longer explain the server's logprobs
        check_matches(hf, original, after, 0.8)
    assert httpx.get(server.url + "/health").json()["version"] == 1
    assert "inflight_weight_version 1" in httpx.get(server.url + "/metrics").text


def test_bucket_layout_packs_small_tensors_in_order_and_leaves_large_ones_alone():
    from inflight.transport.layout import BUCKET_ALIGN, bucket_layout, packed_bytes
    from inflight.transport.schemas import ParamInfo

    shapes = [([3], "float32"), ([100, 100], "float32"), ([5], "bfloat16"), ([7, 3], "float16"), ([1000, 1000],
              "float32"), ([9], "float32")]
    params = [ParamInfo(name=f"p{i}", shape=s, dtype=d) for i, (s, d) in enumerate(shapes)]
    nbytes = [12, 40000, 10, 42, 4000000, 36]
    assert bucket_layout(params, 0) == [[(i, 0)] for i in range(6)]  # 0: one broadcast per tensor, as before
    layout = bucket_layout(params, 50_000)
    assert layout == [[(0, 0), (1, 64), (2, 40064), (3, 40128)], [(4, 0)], [(5, 0)]]
    for bucket in layout:
        assert [i for i, _ in bucket] == sorted(i for i, _ in bucket)  # announced order
        ends = [off + nbytes[i] for i, off in bucket]
        assert all(off % BUCKET_ALIGN == 0 for _, off in bucket)
        assert all(b_off >= a_end for (_, b_off), a_end in zip(bucket[1:], ends))  # no overlap
        assert packed_bytes(params, bucket) == (ends[-1] if len(bucket) > 1 else 0)  # a lone tensor: itself
        assert len(bucket) == 1 or ends[-1] <= 50_000  # only a lone tensor may exceed the bucket
    assert [i for b in layout for i, _ in b] == list(range(6))


def test_bucketed_push_lands_every_tensor_in_its_place(server, hf, sync, monkeypatch):
    """Small tensors packed into shared buffers at their offsets, large ones sent alone: the server's logprobs
    match the new weights exactly, for a whole-model update and for a partial one in another order."""
    sent: list[int] = []
    send_all = sync._send_all
    monkeypatch.setattr(sync, "_send_all", lambda payload, gen: (sent.append(len(payload)), send_all(payload, gen)))
    monkeypatch.setattr(sync, "bucket_bytes", 20_000)
    new = perturbed(hf, seed=11)
    sync.push(new.items(), version=11)
    assert 1 < sent[-1] < len(new)  # fewer broadcasts than tensors
    check_matches(hf, new, chat(server.url, temperature=0.9), 0.9)
    names = sorted(new, reverse=True)[::2]  # a subset, announced in another order
    partial = {n: t + 0.02 for n, t in perturbed(hf, seed=12).items() if n in names}
    sync.push(partial.items(), version=12)
    check_matches(hf, {**new, **partial}, chat(server.url, temperature=0.9), 0.9)


def test_bad_updates_are_rejected_and_change_nothing(server, hf, sync):
    sync.push(perturbed(hf, seed=2).items(), version=13)  # versions never go back: after the tests before
    ref = fingerprint(server.url)
    spec = [{"name": n, "shape": list(p.shape), "dtype": "float32"} for n, p in hf.named_parameters()]
    bad_bodies = {
        "shape": [{**spec[0], "shape": [3, 3]}],
        "unknown": [{"name": "no.such.weight", "shape": [4], "dtype": "float32"}],
        "duplicate": [spec[1], spec[1]],
        "dtype": [{**spec[0], "dtype": "bfloat16"}],
    }
    for what, params in bad_bodies.items():
        r = httpx.post(server.url + "/request_weight_update", json={"version": 19, "params": params}, timeout=10)
        assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
    r = httpx.post(server.url + "/request_weight_update", json={"version": 19, "path": "/dev/shm/missing.st"})
    assert r.status_code == 400 and "not a readable safetensors file" in r.text
    # through the client: a wrong tensor is refused before anything is broadcast, naming the server
    wrong = [(n, t if i else torch.zeros(2, 2)) for i, (n, t) in enumerate(perturbed(hf, 3).items())]
    with pytest.raises(WeightSyncError, match=server.url):
        sync.push(wrong, version=19)
    assert fingerprint(server.url) == ref  # weights and version exactly as they were
    # and the group is still usable
    new = perturbed(hf, seed=4)
    sync.push(new.items(), version=14)
    check_matches(hf, new, chat(server.url, temperature=1.0), 1.0)


def test_dry_run_only_for_an_announcement_not_yet_taken(server, hf, sync, monkeypatch):
    """The dry run checks names, shapes and dtypes: an announcement every server took on this group is not
    checked again; another one (a wrong tensor) is, and is refused before any broadcast."""
    paths = []
    real = sync.post
    monkeypatch.setattr(sync, "post", lambda url, path, *a: paths.append(path) or real(url, path, *a))
    sync.push(perturbed(hf, seed=6).items(), version=15)  # whatever came before, this announcement was taken
    paths.clear()
    new = perturbed(hf, seed=7)
    sync.push(new.items(), version=16)
    assert paths == ["/request_weight_update"]
    check_matches(hf, new, chat(server.url, temperature=1.0), 1.0)
    wrong = [(n, t if i else torch.zeros(2, 2)) for i, (n, t) in enumerate(new.items())]
    paths.clear()
    with pytest.raises(WeightSyncError, match="shape"):
        sync.push(wrong, version=17)
    assert paths == ["/check_weight_update"]
    assert httpx.get(server.url + "/health").json()["version"] == 16


def test_file_transport(server, hf):
    new = perturbed(hf, seed=5)
    c = WeightSyncClient([server.url], transport="file")
    stats = c.push(new.items(), version=17, mode="interrupt")
    c.close()
    assert stats["num_tensors"] == len(new)
    after = chat(server.url, temperature=1.0)
    assert set(after["token_versions"]) == {17}
    check_matches(hf, new, after, 1.0)


@pytest.mark.parametrize("mode", ["keep", "interrupt"])
def test_update_during_long_generation(server, hf, sync, mode):
    """A generation spanning an update: versions switch once; interrupt = fresh forward of the new weights."""
    base = 30 if mode == "keep" else 40
    old = perturbed(hf, seed=base)
    sync.push(old.items(), version=base)
    new = perturbed(hf, seed=base + 1)
    prompt, seen, got, versions = generation_across_update(
        server.url, MSG, lambda: sync.push(new.items(), version=base + 1, mode=mode), base, base + 1)
    switch = versions.index(base + 1)
    assert versions == [base] * switch + [base + 1] * (len(versions) - switch)
    ids, n_prompt = prompt + seen, len(prompt)
    ref_old = reference_logprobs(hf, old, ids, n_prompt, 1.0)
    assert max(abs(a - b) for a, b in zip(got[:switch], ref_old[:switch])) < 1e-4
    ref_new = reference_logprobs(hf, new, ids, n_prompt, 1.0)
    err_new = max(abs(a - b) for a, b in zip(got[switch:], ref_new[switch:]))
    if mode == "interrupt":
        diffs = [round(a - b, 5) for a, b in zip(got[switch:], ref_new[switch:])]
        assert err_new < 1e-4, (switch, len(got), diffs[:20], [i for i, d in enumerate(diffs) if abs(d) > 1e-4][:20])
    else:  # keep: later tokens attend to KV computed by the old weights, so a fresh forward differs
        assert err_new > 1e-3


def test_trainer_step_then_broadcast_server_matches_trainer_forward(tiny_model_dir, server, sync):
    """The trainer contract end to end: a real optimizer step of SingleDeviceTrainer, its named_weights() pushed to
    the running server; the server's logprobs of a completion equal the trainer's own forward_logprobs (1e-4)."""
    from inflight.algo import make_loss
    from inflight.config.algo import AlgoConfig
    from inflight.config.trainer import TrainerConfig
    from inflight.contracts import Sample
    from inflight.trainer.packing import pack_samples
    from inflight.trainer.single import SingleDeviceTrainer

    trainer = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(lr=5e-2, threads=1))
    trainer.init()
    before = chat(server.url, temperature=1.0, seed=3)
    sample = Sample(group_id="g0", prompt_ids=before["prompt_token_ids"], completion_ids=before["token_ids"],
                    logprobs=server_logprobs(before), versions=before["token_versions"])
    (batch,) = pack_samples([sample], [1.0], 4096, 1, len(sample.completion_ids))
    trainer.backward(batch, make_loss(AlgoConfig()))
    trainer.optimizer_step()
    trained = trainer.forward_logprobs(batch)[batch.loss_mask > 0].tolist()
    assert max(abs(a - b) for a, b in zip(trained, sample.logprobs)) > 1e-3  # the step really moved the policy

    version = 42 + trainer.version  # the module's server is past the trainer's own count: versions never go back
    sync.push(trainer.named_weights(), version=version)
    after = chat(server.url, temperature=1.0, seed=3)
    assert set(after["token_versions"]) == {version}
    s2 = Sample(group_id="g1", prompt_ids=after["prompt_token_ids"], completion_ids=after["token_ids"],
                logprobs=server_logprobs(after), versions=after["token_versions"])
    (b2,) = pack_samples([s2], [1.0], 4096, 1, len(s2.completion_ids))
    mine = trainer.forward_logprobs(b2)[b2.loss_mask > 0].tolist()
    assert len(mine) == len(s2.logprobs) > 0
    assert max(abs(a - b) for a, b in zip(mine, s2.logprobs)) < 1e-4, (mine, s2.logprobs)


def test_init_process_group_fails_fast_when_a_server_cannot_join(server):
    """One good server and one address where nothing listens: the call fails at once, naming the dead server,
    instead of waiting for the group's timeout (10 s here); close() then waits for the abandoned set-up to end."""
    from inflight.process import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    client = WeightSyncClient([server.url, dead], timeout_s=10)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=dead.replace(".", r"\.")):
        client.init_process_group()
    assert time.monotonic() - t0 < 5
    client.close()
    assert not client._group_thread.is_alive()  # nothing left blocked in gloo when the process exits


def test_a_new_group_supersedes_a_receive_whose_broadcast_never_comes(server, hf):
    """The server was asked to receive v50 but no tensor comes, and the trainer's end of that group stays open (as
    when its abort cannot free a group with an op still pending). The trainer forms the group again: the stalled
    update answers 409 at once (the group timeout is 60 s), nothing was applied, and a push on the new group lands
    exactly."""
    from inflight.trainer.weight_sync.common import ServerAnswered

    client = WeightSyncClient([server.url], timeout_s=60)
    try:
        client.init_process_group()
        ref = fingerprint(server.url)
        new = perturbed(hf, seed=50)
        body = {"version": 50, "mode": "keep", "params": [
            {"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in new.items()]}
        stalled = client.pool.submit(client.post, server.url, "/request_weight_update", body)
        time.sleep(1.0)
        assert not stalled.done()  # the server is waiting inside the broadcast
        stale = client.group  # kept open: its connections do not close
        client.group, client.store, client.master_port = None, None, 0  # as rejoin_weight_group does
        t0 = time.monotonic()
        client.init_process_group()
        with pytest.raises(ServerAnswered, match=r"HTTP 409.*superseded by a new /init_process_group"):
            stalled.result(timeout=10)
        assert time.monotonic() - t0 < 10
        assert fingerprint(server.url) == ref  # weights and version as they were
        client.push(new.items(), version=51)
        after = chat(server.url, temperature=1.0)
        assert set(after["token_versions"]) == {51}
        check_matches(hf, new, after, 1.0)
        del stale
    finally:
        client.close()


def test_helper_threads_make_the_trainer_device_current(server, hf, monkeypatch):
    """A CUDA trainer's weight group is built and driven on helper threads, which start on device 0 whatever the
    trainer uses: each makes the trainer's device current first (recorded here through torch.cuda.set_device; the
    group is gloo on CPU tensors, so nothing else needs a GPU)."""
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, str(d))))
    client = WeightSyncClient([server.url], timeout_s=60, device="cuda:3", bucket_bytes=2**20)
    try:
        client.init_process_group()
        new = perturbed(hf, seed=60)
        client.push(new.items(), version=60)
        check_matches(hf, new, chat(server.url, temperature=1.0), 1.0)
    finally:
        client.close()
    assert ("weight-group", "cuda:3") in calls and ("broadcast-v60", "cuda:3") in calls


def test_a_tied_alias_is_sent_once(server, hf, monkeypatch):
    """Two names for one tensor (a tied model's state_dict lists lm_head.weight as an alias of the embedding): only
    the first name is announced and sent (the server's model has no such alias and would reject it)."""
    new = perturbed(hf, seed=61)
    emb = new["model.embed_tokens.weight"]
    named = [*new.items(), ("model.embed_tokens_alias.weight", emb)]  # same storage under a later name
    client = WeightSyncClient([server.url], transport="file", timeout_s=60)
    try:
        stats = client.push(named, version=61)
    finally:
        client.close()
    assert stats["num_tensors"] == len(new)
    check_matches(hf, new, chat(server.url, temperature=1.0), 1.0)
