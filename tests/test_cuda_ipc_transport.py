"""The same-device transport (trainer.weight_transport=cuda_ipc, inflight/transport/cuda_ipc.py) against a real `inflight
serve` process: on CPU through its stand-in (a shared-memory file in place of the CUDA IPC handle: the same
protocol, header and refusals), on a GPU through real CUDA IPC. Logprobs after a push are compared with an
independent float64 transformers forward of the pushed weights; every refusal leaves weights and version as they
were."""

from __future__ import annotations

import base64
import json
import os

import httpx
import pytest
import torch
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from inflight.engine.weights.ipc_receiver import ipc_local_only
from inflight.trainer.weight_sync.common import WeightSyncError
from inflight.trainer.weight_sync.inflight import WeightSyncClient
from inflight.transport.cuda_ipc import IPC_HEADER_BYTES, IpcError, IpcWriter, check_handle, open_buffer
from inflight.transport.schemas import IpcBuffer, WeightUpdateRequest
from tests.test_weight_sync import chat, check_matches, fingerprint, perturbed, reference_logprobs, server_logprobs

torch.set_num_threads(1)
CUDA = torch.device("cuda", 0)
GPU = "GPU-0b1f3e55-6d0a-4c2e-9a51-3f2d7c8e9a10"  # the server's GPU in the handle-field tests


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from inflight.engine.serve import ServerProcess

    args = ["--max-model-len", "512", "--no-prefix-reuse"]  # bit-reproducible fingerprints (test_weight_sync.py)
    with ServerProcess(str(tiny_model_dir), extra_args=args, env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ipc(server):
    c = WeightSyncClient([server.url], transport="cuda_ipc", timeout_s=60)
    yield c
    c.close()


def version_of(url: str) -> int:
    return httpx.get(url + "/health").json()["version"]


def test_pushes_reach_the_server_through_one_buffer(server, hf, ipc):
    new = perturbed(hf, seed=1)
    stats = ipc.push(new.items(), version=1)
    assert stats["bytes"] == sum(t.numel() * 4 for t in new.values()) and stats["write_s"] >= 0
    path = ipc._ipc.path
    assert path.startswith("/dev/shm/") and os.path.getsize(path) == IPC_HEADER_BYTES + ipc._ipc.layout[2]
    after = chat(server.url, temperature=0.8)
    assert set(after["token_versions"]) == {1} and version_of(server.url) == 1
    check_matches(hf, new, after, 0.8)
    newer = perturbed(hf, seed=2)
    ipc.push(newer.items(), version=2, mode="interrupt")
    assert ipc._ipc.path == path  # the buffer persists across pushes: exported once, written again
    assert version_of(server.url) == 2
    check_matches(hf, newer, chat(server.url, temperature=1.0), 1.0)


def test_bad_updates_are_refused_and_change_nothing(server, hf, ipc, tmp_path):
    url = server.url
    good = perturbed(hf, seed=5)
    ipc.push(good.items(), version=5)
    ref = fingerprint(url)
    params = [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in good.items()]
    handle = dict(ipc._ipc.handle)
    body = {"version": 6, "params": params, "ipc": handle}

    def refused(b: dict, match: str, status: int = 400) -> None:
        r = httpx.post(url + "/request_weight_update", json=b, timeout=30)
        assert r.status_code == status and match in r.json()["error"]["message"], r.text

    # the buffer holds v5: an announcement of v6 over it is not what the bytes are
    refused(body, "holds weight version 5, the update announces 6")
    refused({**body, "version": 4}, "stale version", 409)  # token_versions may never go back
    with open(ipc._ipc.path, "r+b") as f:  # the header of a v6 (a trainer writes the tensors first)
        f.seek(8)
        f.write((6).to_bytes(8, "little"))
    swapped = [params[1], params[0], *params[2:]]  # same size in all, other tensors at the offsets
    refused({**body, "params": swapped}, "other tensors than announced")
    wrong = [{**params[0], "shape": [params[0]["shape"][0] + 1, *params[0]["shape"][1:]]}, *params[1:]]
    refused({**body, "params": wrong}, "shape")  # the layout does not fit the model
    refused({**body, "ipc": {**handle, "bytes": handle["bytes"] + 64}}, "the announced tensors need header")
    refused({**body, "ipc": {**handle, "path": "relative/file"}}, "must be absolute")
    refused({**body, "ipc": {**handle, "path": "/dev/shm/inflight-no-such-buffer"}}, "not a readable ipc buffer")
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)  # opening it would block the server: refused from its file type
    refused({**body, "ipc": {**handle, "path": fifo}}, "not a readable ipc buffer")  # one message: no probing
    refused({**body, "ipc": {**handle, "kind": "cuda", "device": 0, "handle": base64.b64encode(b"x" * 64).decode()}},
            "for a server on the CPU")
    r = httpx.post(url + "/request_weight_update", json={**body, "ipc": {**handle, "pickle": "gASV"}}, timeout=30)
    assert r.status_code in (400, 422) and "pickle" in r.text  # no field outside the schema
    with open(ipc._ipc.path, "r+b") as f:  # a buffer being written: its magic is zero until the data is complete
        f.write(b"\0" * 8)
    refused({**body, "version": 6}, "being written")
    assert fingerprint(url) == ref and version_of(url) == 5

    poisoned = dict(good)
    name = list(good)[3]
    poisoned[name] = good[name].clone()
    poisoned[name].view(-1)[7] = float("inf")
    with pytest.raises(WeightSyncError, match=rf"NaN or Inf values in \['{name}'\]"):
        ipc.push(poisoned.items(), version=7)
    assert fingerprint(url) == ref and version_of(url) == 5  # the old weights and version, still served
    assert ipc._ipc.path is None  # a failed push: the next one writes a new buffer
    with pytest.raises(WeightSyncError, match="stale version"):
        ipc.push(good.items(), version=4)
    ipc.push(perturbed(hf, seed=9).items(), version=5)  # the version it holds: answered, nothing copied
    assert fingerprint(url) == ref and version_of(url) == 5
    newer = perturbed(hf, seed=8)
    ipc.push(newer.items(), version=8)
    assert version_of(url) == 8
    check_matches(hf, newer, chat(url, temperature=1.0), 1.0)


def test_a_retry_reaches_the_server_that_missed_it(server, hf, tiny_model_dir):
    """One server applied v20, the other did not: the retry of v20 to both is answered by both, copied only by the
    one that missed it (a version names one set of weights), and both serve v20."""
    from inflight.engine.serve import ServerProcess

    args = ["--max-model-len", "512", "--no-prefix-reuse"]
    with ServerProcess(str(tiny_model_dir), extra_args=args, env={"OMP_NUM_THREADS": "1"}) as other:
        v20 = perturbed(hf, seed=20)
        one = WeightSyncClient([server.url], transport="cuda_ipc", timeout_s=60)
        both = WeightSyncClient([server.url, other.url], transport="cuda_ipc", timeout_s=60)
        try:
            one.push(v20.items(), version=20)
            assert version_of(server.url) == 20 and version_of(other.url) == 0
            body = {"version": 20, "params": [{"name": n, "shape": list(t.shape), "dtype": "float32"}
                                              for n, t in v20.items()], "ipc": one._ipc.handle}
            r = httpx.post(server.url + "/request_weight_update", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["applied"] is False
            both.push(v20.items(), version=20)
            for url in (server.url, other.url):
                assert version_of(url) == 20
                check_matches(hf, v20, chat(url, temperature=1.0), 1.0)
        finally:
            one.close()
            both.close()


def test_a_cpu_handle_round_trips():
    w = IpcWriter(None)
    try:
        t = torch.arange(12, dtype=torch.float32).view(3, 4)
        handle = w.write([("w", t)], ["bfloat16"], [0], 24, 3, b"d" * 32)
        ipc = IpcBuffer(**handle)
        check_handle(ipc, 24, torch.device("cpu"))
        buf = open_buffer(ipc)
        got = buf[IPC_HEADER_BYTES: IPC_HEADER_BYTES + 24].view(torch.bfloat16).view(3, 4)
        assert torch.equal(got, t.to(torch.bfloat16))
        with pytest.raises(IpcError, match="the announced tensors need header"):
            check_handle(ipc, 28, torch.device("cpu"))
    finally:
        w.discard()


def cuda_fields(**over) -> IpcBuffer:
    fields = {"kind": "cuda", "bytes": IPC_HEADER_BYTES + 1024, "device": 0, "device_uuid": GPU,
              "handle": base64.b64encode(bytes(range(64))).decode(), "storage_bytes": 1 << 20,
              "storage_offset_bytes": 0, "ref_counter_handle": base64.b64encode(b"/torch_123_456_0").decode(),
              "ref_counter_offset": 0, "event_handle": base64.b64encode(bytes(64)).decode(),
              "event_sync_required": True}
    return IpcBuffer(**{**fields, **over})


@pytest.mark.parametrize("over, match", [
    ({"device": 1}, "this server is on cuda:0"),
    ({"device_uuid": "GPU-11111111-2222-3333-4444-555555555555"}, "on one GPU"),  # same index, other GPU
    ({"device_uuid": None}, "on one GPU"),
    ({"handle": "not base64!"}, "handle is not base64"),
    ({"handle": None}, "handle is missing"),
    ({"handle": base64.b64encode(bytes(4096)).decode()}, "longer than"),
    ({"ref_counter_handle": base64.b64encode(b"../../etc/passwd").decode()}, "not a shared-memory name"),
    ({"event_handle": "", "event_sync_required": True}, "needs an event_handle of 64 bytes"),
    ({"event_handle": base64.b64encode(bytes(63)).decode()}, "needs an event_handle of 64 bytes"),
    ({"storage_bytes": 1000}, "cannot hold the buffer"),
    ({"bytes": 1024}, "the announced tensors need header"),
])
def test_tampered_cuda_handle_fields_are_refused(over, match):
    check_handle(cuda_fields(), 1024, CUDA, GPU)  # the untampered fields pass (nothing is opened)
    with pytest.raises(IpcError, match=match):
        check_handle(cuda_fields(**over), 1024, CUDA, GPU)


def test_the_contract_takes_ipc_with_params_only():
    p = [{"name": "w", "shape": [2], "dtype": "float32"}]
    ipc = {"kind": "cpu", "bytes": 320, "path": "/dev/shm/x"}
    WeightUpdateRequest(version=1, params=p, ipc=ipc)
    for bad in ({"version": 1, "path": "/x.safetensors", "ipc": ipc},
                {"version": 1, "params": p, "ipc": ipc, "bucket_bytes": 64},
                {"version": 1, "params": p, "ipc": ipc, "shm": {"path": "/dev/shm/x", "bytes": 10}},
                {"version": 1, "params": p, "ipc": {**ipc, "kind": "pickle"}}):
        with pytest.raises(ValidationError):
            WeightUpdateRequest(**bad)


def test_ipc_updates_come_from_this_host_only():
    app = FastAPI()

    @app.post("/request_weight_update", dependencies=[Depends(ipc_local_only)])
    async def update() -> dict:
        return {"ok": True}

    body = {"version": 1, "ipc": {"kind": "cpu"}}
    remote = TestClient(app, client=("10.1.2.3", 5000))
    r = remote.post("/request_weight_update", json=body)
    assert r.status_code == 403 and "this host only" in r.text
    assert remote.post("/request_weight_update", json={"version": 1}).status_code == 200  # other transports pass
    local = TestClient(app, client=("127.0.0.1", 5000))
    assert local.post("/request_weight_update", json=body).status_code == 200


def matches_on_gpu(hf, weights: dict, choice: dict, temp: float, tol: float = 2e-3) -> None:
    """The server's logprobs against the float64 softmax of a CPU transformers forward (GPU kernels round
    differently from the CPU's: a looser bound than check_matches)."""
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    ref = reference_logprobs(hf, weights, ids, len(choice["prompt_token_ids"]), temp)
    got = server_logprobs(choice)
    assert len(got) == len(ref) > 0
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < tol, (got, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_ipc_on_one_gpu(tiny_model_dir, hf):
    """The real path: the server (inheriting this process's CUDA_VISIBLE_DEVICES) on cuda:0, the trainer's buffer on
    cuda:0, handles opened by the server."""
    from inflight.engine.serve import ServerProcess

    def gpu(weights: dict) -> list:
        return [(n, t.to(CUDA)) for n, t in weights.items()]

    args = ["--max-model-len", "512", "--no-prefix-reuse", "--device", "cuda", "--dtype", "float32"]
    with ServerProcess(str(tiny_model_dir), extra_args=args) as s:
        c = WeightSyncClient([s.url], transport="cuda_ipc", timeout_s=120, device="cuda:0")
        try:
            new = perturbed(hf, seed=21)
            c.push(gpu(new), version=1)
            handle = c._ipc.handle
            assert handle["kind"] == "cuda" and c._ipc.buf.device.type == "cuda"
            check_handle(IpcBuffer(**json.loads(json.dumps(handle))), c._ipc.layout[2], CUDA)  # JSON round trip
            matches_on_gpu(hf, new, chat(s.url, temperature=1.0), 1.0)
            ref = fingerprint(s.url)
            poisoned = dict(gpu(perturbed(hf, seed=22)))
            next(iter(poisoned.values())).view(-1)[0] = float("nan")
            with pytest.raises(WeightSyncError, match="NaN or Inf"):
                c.push(poisoned.items(), version=2)
            assert fingerprint(s.url) == ref and version_of(s.url) == 1
            newer = perturbed(hf, seed=23)
            c.push(gpu(newer), version=3)
            handle = dict(c._ipc.handle)
            matches_on_gpu(hf, newer, chat(s.url, temperature=1.0), 1.0)
            newest = perturbed(hf, seed=24)
            c.push(gpu(newest), version=4)
            assert c._ipc.handle == handle  # one buffer, exported once, written again
            matches_on_gpu(hf, newest, chat(s.url, temperature=1.0), 1.0)
            ref = fingerprint(s.url)
            params = [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in newest.items()]
            for bad, match in [({"handle": base64.b64encode(os.urandom(64)).decode()}, "cannot open the ipc handle"),
                               ({"device": 1}, "on one GPU"), ({"device_uuid": "GPU-other"}, "on one GPU")]:
                r = httpx.post(s.url + "/request_weight_update", timeout=60,
                               json={"version": 5, "params": params, "ipc": {**handle, **bad}})
                assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
            assert fingerprint(s.url) == ref and version_of(s.url) == 4  # still serving v4
            c.push(gpu(newer), version=5)  # the server opens the buffer again after the refusals
            matches_on_gpu(hf, newer, chat(s.url, temperature=1.0), 1.0)
        finally:
            c.close()
