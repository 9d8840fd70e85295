"""Hostile weight updates against the built-in server (`inflight serve` in a subprocess; this test process is trainer
rank 0): a rendezvous that never comes, an adapter whose merge overflows, versions that go back, a dry run of a file
the update would refuse, paths probed through refusal messages, and a segment rewritten after it was accepted. After
every refusal the weights and the version are exactly as they were and a normal request answers as before
(fingerprint: seeded sampling with top-20 logprobs). Also the vLLM launcher's app: the master-address rule."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import save_file

from inflight.engine.serve import ServerProcess
from inflight.process import free_port
from inflight.trainer.weight_sync.common import WeightSyncError
from inflight.trainer.weight_sync.inflight import WeightSyncClient
from inflight.transport.cuda_ipc import IPC_HEADER_BYTES
from inflight.transport.layout import shm_layout
from inflight.transport.schemas import ParamInfo, WeightUpdateRequest
from inflight.transport.shm import SHM_HEADER_BYTES
from tests.security.test_weight_abuse import AUTH, ENV, KEY, fingerprint

torch.set_num_threads(1)
Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = ["--api-key", KEY, "--max-model-len", "128", "--no-prefix-reuse"]  # bit-reproducible fingerprints
    with ServerProcess(str(tiny_model_dir), extra_args=args, env=ENV) as p:
        yield p


@pytest.fixture(scope="module")
def weights(tiny_model_dir) -> dict[str, torch.Tensor]:
    """The server's own weights (pushing them again changes the version only), by parameter name."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in hf.named_parameters()}


@pytest.fixture(scope="module")
def weights_file(weights, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("weights") / "same.safetensors"
    save_file(weights, str(path))
    return str(path)


@pytest.fixture(scope="module")
def sync(server):
    c = WeightSyncClient([server.url], api_key=KEY, timeout_s=60)
    c.init_process_group()
    yield c
    c.close()


def post(url: str, path: str, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=timeout)


def regroup(sync: WeightSyncClient) -> None:
    """Form the weight group again on a fresh port, as the trainer does (restart.rejoin_weight_group)."""
    sync.drop_group()
    sync.master_port = 0
    sync.init_process_group()


def version(url: str) -> int:
    return httpx.get(url + "/health").json()["version"]


def message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


def overflowing_adapter(weights: dict, scale: float = 1e3) -> dict[str, torch.Tensor]:
    """Finite A and B (1e3 each) whose B @ A times a scaling of 1e35 is far past float32's 3.4e38."""
    n_out, n_in = weights[Q0].shape
    return {Q0 + ".lora_A": torch.full((2, n_in), scale), Q0 + ".lora_B": torch.full((n_out, 2), scale)}


# ---- 2: a rendezvous that never comes -----------------------------------------------------------------------------
def test_the_group_timeout_is_bounded(server):
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    for timeout in (1e9, 601, 0):
        t0 = time.monotonic()
        r = post(server.url, "/init_process_group", {**body, "timeout_s": timeout})
        assert r.status_code == 400 and "timeout_s" in r.text, (timeout, r.status_code, r.text)
        assert time.monotonic() - t0 < 5


def test_a_rendezvous_that_never_comes_blocks_no_update(server, weights_file, sync, weights):
    """A join to a port nobody listens on waits up to its timeout_s (600 s here): file and shm updates go on
    meanwhile, broadcasts wait for the group (409), and the trainer's next join supersedes the dead one."""
    ref = fingerprint(server.url)
    answer: list[httpx.Response] = []
    dead = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "timeout_s": 600}
    t = threading.Thread(target=lambda: answer.append(post(server.url, "/init_process_group", dead, timeout=120)))
    t.start()
    deadline = time.monotonic() + 30
    while f"127.0.0.1:{dead['master_port']} (rank 1 of 2, waiting" not in server.log_tail(50):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    spec = [{"name": n, "shape": list(p.shape), "dtype": "float32"} for n, p in weights.items()]
    r = post(server.url, "/request_weight_update", {"version": ref[2] + 1, "params": spec})
    assert r.status_code == 409 and "rendezvous" in message(r), r.text  # broadcasts wait for the new group
    t0 = time.monotonic()
    r = post(server.url, "/request_weight_update", {"version": ref[2] + 1, "path": weights_file})
    assert r.status_code == 200, r.text
    shm = WeightSyncClient([server.url], api_key=KEY, transport="shm", timeout_s=60)
    try:
        shm.push(list(weights.items()), version=ref[2] + 2)
    finally:
        shm.close()
    assert time.monotonic() - t0 < 30 and t.is_alive()  # both applied while the join still waits
    regroup(sync)  # the trainer forms its group again: the waiting join is given up
    t.join(30)
    assert not t.is_alive() and answer[0].status_code == 409 and "superseded" in message(answer[0])
    sync.push(list(weights.items()), version=ref[2] + 3)  # the new group works
    after = fingerprint(server.url)
    assert after[:2] == ref[:2] and after[2] == ref[2] + 3


# ---- 3: an adapter whose merge overflows ----------------------------------------------------------------------------
def test_an_adapter_whose_merge_overflows_is_refused(server, weights, sync, tmp_path):
    ref = fingerprint(server.url)
    adapter = overflowing_adapter(weights)
    assert all(bool(torch.isfinite(t).all()) for t in adapter.values())
    path = tmp_path / "adapter.safetensors"
    save_file(adapter, str(path))
    r = post(server.url, "/request_weight_update", {"version": ref[2] + 1, "path": str(path),
                                                     "adapter": {"rank": 2, "scaling": 1e35}})
    assert r.status_code == 400 and "merged" in message(r) and Q0 in message(r), r.text
    assert fingerprint(server.url) == ref
    shm = WeightSyncClient([server.url], api_key=KEY, transport="shm", timeout_s=60)
    try:
        for client in (shm, sync):  # the same refusal over shared memory and over the group's broadcast
            with pytest.raises(WeightSyncError, match="merged"):
                client.push(list(adapter.items()), version=ref[2] + 1, adapter={"rank": 2, "scaling": 1e35})
            assert fingerprint(server.url) == ref
    finally:
        shm.close()
    small = {n: t * 1e-3 for n, t in adapter.items()}  # the same adapter, merged finite: applied
    sync.push(list(small.items()), version=ref[2] + 1, adapter={"rank": 2, "scaling": 1e-3})
    assert fingerprint(server.url)[2] == ref[2] + 1
    sync.push(list(weights.items()), version=ref[2] + 2)  # a full update drops the adapter
    assert fingerprint(server.url)[:2] == ref[:2]


# ---- 4: versions never go back ----------------------------------------------------------------------------------------
def test_versions_never_go_back_on_any_transport(server, weights, weights_file, sync, tmp_path):
    v = version(server.url) + 2
    assert post(server.url, "/request_weight_update", {"version": v, "path": weights_file}).status_code == 200
    ref = fingerprint(server.url)
    stale = v - 1
    spec = [{"name": n, "shape": list(p.shape), "dtype": "float32"} for n, p in weights.items()]
    adapter = tmp_path / "adapter.safetensors"
    save_file({n: t * 1e-3 for n, t in overflowing_adapter(weights).items()}, str(adapter))
    bodies = {"file": {"path": weights_file}, "broadcast": {"params": spec},
              "adapter": {"path": str(adapter), "adapter": {"rank": 2, "scaling": 1.0}}}
    for what, body in bodies.items():
        for route in ("/check_weight_update", "/request_weight_update"):
            r = post(server.url, route, {"version": stale, **body})
            assert r.status_code == 409 and "stale version" in message(r), (what, route, r.text)
            assert fingerprint(server.url) == ref
    shm = WeightSyncClient([server.url], api_key=KEY, transport="shm", timeout_s=60)
    try:
        shm.push(list(weights.items()), version=v)  # a client's first push says new_run: the rule holds after it
        sync.push(list(weights.items()), version=v)
        with pytest.raises(WeightSyncError, match="stale version"):
            shm.push(list(weights.items()), version=stale)
        assert fingerprint(server.url) == ref
        with pytest.raises(WeightSyncError, match="stale version"):
            sync.push(list(weights.items()), version=stale)
        assert fingerprint(server.url) == ref
        regroup(sync)  # a refused broadcast makes the trainer let its group go
        # the version served again is a retry: applied on every transport (ipc answers it without copying)
        shm.push(list(weights.items()), version=v)
        sync.push(list(weights.items()), version=v)
        assert post(server.url, "/request_weight_update", {"version": v, "path": weights_file}).status_code == 200
        assert fingerprint(server.url) == ref
    finally:
        shm.close()
    # versions are i64 on the wire (shm and ipc headers): one past the largest is refused by the schema
    for bad in (2**63, -1):
        r = post(server.url, "/check_weight_update", {"version": bad, "path": weights_file})
        assert r.status_code == 400 and "version" in r.text, (bad, r.text)
    r = post(server.url, "/check_weight_update", {"version": 2**63 - 1, "path": weights_file})
    assert r.status_code == 200 and r.json() == {"ok": True}, r.text
    assert fingerprint(server.url) == ref


def test_a_trainers_first_update_may_start_a_new_run(server, weights, weights_file):
    """A new run (or a trainer resumed from an older checkpoint) on servers an earlier run left at a later version:
    its first update says new_run and may go back; later ones may not."""
    high = version(server.url) + 50
    assert post(server.url, "/request_weight_update", {"version": high, "path": weights_file}).status_code == 200
    ref = fingerprint(server.url)
    trainer = WeightSyncClient([server.url], api_key=KEY, transport="file", timeout_s=60)
    try:
        trainer.push(list(weights.items()), version=3)  # its first push: new_run
        assert version(server.url) == 3
        with pytest.raises(WeightSyncError, match="stale version"):
            trainer.push(list(weights.items()), version=2)
        assert version(server.url) == 3
        trainer.push(list(weights.items()), version=4)
    finally:
        trainer.close()
    assert fingerprint(server.url)[:2] == ref[:2]  # the same weights, at the new run's version
    r = post(server.url, "/request_weight_update", {"version": 1, "path": weights_file})
    assert r.status_code == 409 and "new_run" in message(r)
    r = post(server.url, "/request_weight_update", {"version": 1, "path": weights_file, "new_run": True})
    assert r.status_code == 200 and version(server.url) == 1


# ---- 5: the dry run checks what the update checks ---------------------------------------------------------------------
def test_the_dry_run_refuses_what_the_update_refuses(server, weights, weights_file, tmp_path):
    ref = fingerprint(server.url)
    name = next(iter(weights))
    files = {"wrong shape": {name: torch.zeros(2, 2)}, "unknown name": {"evil.weight": torch.zeros(2)},
             "wrong dtype": {name: weights[name].half()}, "no tensors": {}}
    paths = {"missing": "/nonexistent/x.safetensors", "a folder": str(tmp_path), "relative": "x.safetensors"}
    for what, tensors in files.items():
        paths[what] = str(tmp_path / f"{what.replace(' ', '_')}.safetensors")
        save_file(tensors, paths[what])
    paths["a pickle"] = str(tmp_path / "weights.pt")
    torch.save(weights, paths["a pickle"])
    paths["truncated"] = str(tmp_path / "truncated.safetensors")
    with open(weights_file, "rb") as f:
        head = f.read(200)
    with open(paths["truncated"], "wb") as f:
        f.write(head)  # the length field promises a header the file does not hold
    for what, path in paths.items():
        dry = post(server.url, "/check_weight_update", {"version": ref[2] + 1, "path": path})
        real = post(server.url, "/request_weight_update", {"version": ref[2] + 1, "path": path})
        assert dry.status_code == real.status_code == 400, (what, dry.text, real.text)
        assert fingerprint(server.url) == ref
    r = post(server.url, "/check_weight_update", {"version": ref[2] + 1, "path": weights_file})
    assert r.status_code == 200 and r.json() == {"ok": True}
    assert fingerprint(server.url) == ref  # a dry run applies nothing


# ---- 12d: refusals do not tell which paths exist, or their size -----------------------------------------------------
def _unreadable_paths(tmp_path) -> dict[str, str]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # never read: a read would block
    (tmp_path / "small").write_bytes(b"x" * 10)
    (tmp_path / "large").write_bytes(b"\0" * 50_000)
    (tmp_path / "secret").write_bytes(b"\0" * 4096)
    (tmp_path / "secret").chmod(0)
    paths = {"missing": "/nonexistent/nothing-here", "a folder": str(tmp_path), "a fifo": str(fifo),
             "a device": "/dev/null", "small file": str(tmp_path / "small"), "large file": str(tmp_path / "large")}
    if os.geteuid() != 0:  # root reads it anyway
        paths["unreadable"] = str(tmp_path / "secret")
    return paths


def _same_message(answers: dict[str, httpx.Response], paths: dict[str, str]) -> str:
    shown = {}
    for what, r in answers.items():
        assert r.status_code == 400, (what, r.text)
        shown[what] = message(r).replace(repr(paths[what]), "PATH")
    assert len(set(shown.values())) == 1, shown
    return next(iter(shown.values()))


def test_refusals_do_not_tell_which_paths_exist(server, weights, tmp_path):
    ref = fingerprint(server.url)
    paths = _unreadable_paths(tmp_path)
    v = ref[2] + 1
    files = {w: post(server.url, "/request_weight_update", {"version": v, "path": p}) for w, p in paths.items()}
    text = _same_message(files, paths)
    assert "50000" not in text and "No such file" not in text and "ermission" not in text
    params = [{"name": Q0, "shape": list(weights[Q0].shape), "dtype": "float32"}]
    _, data = shm_layout([ParamInfo(**params[0])])
    size = SHM_HEADER_BYTES + data
    (tmp_path / "no-magic").write_bytes(b"\0" * size)  # the announced size, but no segment
    paths["no segment header"] = str(tmp_path / "no-magic")
    shm = {w: post(server.url, "/request_weight_update",
                   {"version": v, "params": params, "shm": {"path": p, "bytes": size}}) for w, p in paths.items()}
    text = _same_message(shm, paths)
    assert "50000" not in text and "No such file" not in text and "one host" in text
    ipc_size = IPC_HEADER_BYTES + data
    (tmp_path / "no-magic").write_bytes(b"\0" * ipc_size)
    ipc = {w: post(server.url, "/request_weight_update",
                   {"version": v, "params": params, "ipc": {"kind": "cpu", "bytes": ipc_size, "path": p}})
           for w, p in paths.items()}
    _same_message(ipc, paths)
    log = server.log_tail(400)
    assert "No such file" in log and "not a regular file" in log  # the reasons, for the operator only
    assert fingerprint(server.url) == ref


# ---- 12b: a segment rewritten after it was accepted -------------------------------------------------------------------
def test_a_segment_rewritten_after_the_answer_changes_nothing(server, weights, sync):
    """The trainer keeps its segment writable: NaN written into it after the update was answered must not reach what
    the server computes with."""
    shm = WeightSyncClient([server.url], api_key=KEY, transport="shm", timeout_s=60)
    new = {n: t + 0.05 for n, t in weights.items()}
    try:
        v = version(server.url) + 1
        shm.push(list(new.items()), version=v)
        applied = fingerprint(server.url)
        assert applied[2] == v
        segment = shm._shm._cur  # the trainer's own writable mapping of its segment
        assert segment is not None and segment.data is not None
        segment.data.view(torch.float32).fill_(float("nan"))
        assert fingerprint(server.url) == applied
    finally:
        shm.close()
    sync.push(list(weights.items()), version=v + 1)


@pytest.mark.parametrize("staged", [True, False])
def test_a_segment_rewritten_between_check_and_pause_is_not_applied(tied_model_dir, tmp_path, monkeypatch, staged):
    """In process, made deterministic by rewriting the segment with NaN in the engine's pause, just before the
    update is applied: what the server applies is the copy it checked (the staged blocks, and the norms it copies
    apart: `staged`; everything, without staging)."""
    from inflight.engine.core import InferenceEngine
    from inflight.engine.weights.receiver import WeightReceiver
    from inflight.transport.shm import ShmWriter, announcement_digest

    monkeypatch.setenv("INFLIGHT_STAGE_UPDATES", "1" if staged else "0")
    eng = InferenceEngine(str(tied_model_dir), max_batch=2, max_model_len=64)
    assert eng.runner.double_buffer == staged
    writer, receiver = ShmWriter(str(tmp_path)), WeightReceiver(eng)
    eng.start()
    try:
        g = torch.Generator().manual_seed(1)
        new = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in eng.model.named_parameters()}
        params = [ParamInfo(name=n, shape=list(t.shape), dtype="float32") for n, t in new.items()]
        offsets, data_bytes = shm_layout(params)
        seg = writer.write(list(new.items()), ["float32"] * len(params), offsets, data_bytes, 1,
                           announcement_digest(params))
        run_paused = eng.run_paused

        async def rewritten_first(fn):  # the trainer writes NaN over the whole segment after the server's check
            writer._cur.data.view(torch.float32).fill_(float("nan"))
            return await run_paused(fn)

        monkeypatch.setattr(eng, "run_paused", rewritten_first)
        asyncio.run(receiver.update(WeightUpdateRequest(version=1, params=params, shm=seg)))
        current = dict(eng.model.named_parameters())
        assert eng.version == 1 and all(torch.equal(current[n], t) for n, t in new.items())
    finally:
        eng.stop()
        writer.discard()


# ---- 12a: the vLLM backend's app vets the master address ---------------------------------------------------------------
def test_the_vllm_apps_process_group_route_vets_the_master_address(tiny_model_dir):
    """build_app is the vLLM launcher's app factory, here over a real VLLMWeightReceiver (its vLLM engine is never
    reached: the route refuses first) and the built-in engine for the other routes (tests/engine/test_routers.py).
    The full backend is checked in tests/vllm/test_vllm_backend.py."""
    from fastapi.testclient import TestClient

    from inflight.config.engine import EngineSettings
    from inflight.engine.core import InferenceEngine
    from inflight.engine.vllm_backend.launcher import build_app
    from inflight.engine.vllm_backend.receiver import VLLMWeightReceiver

    engine = InferenceEngine(str(tiny_model_dir), max_batch=2, max_model_len=64)
    receiver = VLLMWeightReceiver(SimpleNamespace(llm=None, version=0), engine.param_specs(), device="cpu")
    app = build_app(engine, receiver, EngineSettings(api_key="k", allow_remote_admin=True), own_port=8123)
    base = {"rank_offset": 1, "world_size": 2, "timeout_s": 5}
    with TestClient(app) as client:
        for what, master in {"third host": ("198.51.100.7", 29500), "privileged port": ("127.0.0.1", 22),
                             "the server's own port": ("127.0.0.1", 8123)}.items():
            r = client.post("/init_process_group", headers={"Authorization": "Bearer k"},
                            json={**base, "master_address": master[0], "master_port": master[1]})
            assert r.status_code == 403 and "master" in r.json()["error"]["message"], (what, r.text)
    assert not receiver.has_group
