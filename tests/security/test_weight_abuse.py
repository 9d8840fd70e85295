"""Weight-update abuse and admin protection of the built-in server (`inflight serve` in a subprocess; this test
process is trainer rank 0). Every rejected request must leave the weights and the version exactly as they were:
checked with a fingerprint (seeded sampling with top-20 logprobs, which any weight change would alter)."""

from __future__ import annotations

import socket

import httpx
import pytest
import torch

from inflight.engine.api.guards import check_master_address
from inflight.engine.serve import ServerProcess
from inflight.process import free_port
from inflight.trainer.weight_sync.common import WeightSyncError
from inflight.trainer.weight_sync.inflight import WeightSyncClient

torch.set_num_threads(1)
KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # --no-prefix-reuse: the fingerprint repeats one request and must be bit-reproducible; with prefix reuse the
    # repeat would run only its last prompt token (the same values up to float32 rounding)
    args = ["--api-key", KEY, "--max-model-len", "128", "--no-prefix-reuse"]
    with ServerProcess(str(tiny_model_dir), extra_args=args, env=ENV) as p:
        yield p


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sync(server):
    c = WeightSyncClient([server.url], api_key=KEY, timeout_s=60)
    c.init_process_group()
    yield c
    c.close()


def fingerprint(url: str) -> tuple:
    model = httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "7+8="}], "max_tokens": 6, "seed": 3,
        "logprobs": True, "top_logprobs": 20, "ignore_eos": True})
    ch = r.json()["choices"][0]
    tops = tuple(tuple(round(t["logprob"], 6) for t in e["top_logprobs"]) for e in ch["logprobs"]["content"])
    return tuple(ch["token_ids"]), tops, httpx.get(url + "/health").json()["version"]


def post(url: str, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=30, **kw)


def with_value(hf, name: str, value: float) -> list[tuple[str, torch.Tensor]]:
    out = []
    for n, p in hf.named_parameters():
        t = p.detach().clone()
        if n == name:
            t.view(-1)[3] = value
        out.append((n, t))
    return out


def test_admin_endpoints_need_the_key_and_log_rejections(server):
    bodies = {"/request_weight_update": {"version": 1, "path": "/dev/shm/x.safetensors"},
              "/check_weight_update": {"version": 1, "path": "/dev/shm/x.safetensors"},
              "/init_process_group": {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1,
                                      "world_size": 2}}
    for path, body in bodies.items():
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = post(server.url, path, body, headers=headers)
            assert r.status_code == 401, (path, headers, r.status_code, r.text)
            assert "API key" in r.json()["error"]["message"]
    log = server.log_tail(400)
    for path in bodies:
        assert f"401 POST {path} from 127.0.0.1" in log


def test_server_binds_to_localhost_by_default(server):
    import argparse

    from inflight.engine import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", "m"])
    assert args.host == "127.0.0.1" and not args.allow_remote_admin and args.reject_nonfinite
    others = [ip for ip in _local_ips() if not ip.startswith("127.")]
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{others[0]}:{server.port}/health", timeout=5)


def test_malformed_updates_are_rejected_before_receiving(server, hf, sync):
    ref = fingerprint(server.url)
    spec = [{"name": n, "shape": list(p.shape), "dtype": "float32"} for n, p in hf.named_parameters()]
    bad = {
        "unknown name": [{"name": "lm_head.weight.evil", "shape": [2], "dtype": "float32"}],
        "wrong shape": [{**spec[0], "shape": [spec[0]["shape"][0] + 1, *spec[0]["shape"][1:]]}],
        "negative shape": [{**spec[0], "shape": [-1, 4]}],
        "wrong dtype": [{**spec[0], "dtype": "bfloat16"}],
        "unknown dtype": [{**spec[0], "dtype": "int64"}],
        "duplicate": [spec[1], spec[2], spec[1]],
        "empty": [],
        "not a list": {"a": 1},
    }
    for what, params in bad.items():
        for path in ("/check_weight_update", "/request_weight_update"):
            r = post(server.url, path, {"version": 5, "params": params})
            assert r.status_code == 400, (what, path, r.status_code, r.text)
            assert r.json()["error"]["message"], what
    # no transport / both transports / negative version
    for body in ({"version": 5}, {"version": 5, "params": spec[:1], "path": "/dev/shm/a.safetensors"},
                 {"version": -1, "params": spec[:1]}):
        assert post(server.url, "/request_weight_update", body).status_code == 400, body
    # through the trainer's client: a wrong shape is refused before anything is broadcast
    wrong = [(n, torch.zeros(3, 3) if i == 0 else p.detach()) for i, (n, p) in enumerate(hf.named_parameters())]
    with pytest.raises(WeightSyncError, match="shape"):
        sync.push(wrong, version=5)
    assert fingerprint(server.url) == ref


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_broadcast_is_rejected_after_receiving(server, hf, sync, value):
    ref = fingerprint(server.url)
    with pytest.raises(WeightSyncError, match="NaN or Inf"):
        sync.push(with_value(hf, "model.layers.1.mlp.up_proj.weight", value), version=11)
    assert fingerprint(server.url) == ref  # weights and version untouched
    assert sync.group is not None  # every tensor was delivered: a rejection of content keeps the group


def test_nonfinite_file_is_rejected(server, hf):
    ref = fingerprint(server.url)
    c = WeightSyncClient([server.url], api_key=KEY, transport="file", timeout_s=60)
    try:
        with pytest.raises(WeightSyncError, match="NaN or Inf"):
            c.push(with_value(hf, "model.embed_tokens.weight", float("nan")), version=12)
    finally:
        c.close()
    assert fingerprint(server.url) == ref


def test_bad_files_are_rejected(server, hf, tmp_path):
    from safetensors.torch import save_file

    ref = fingerprint(server.url)
    name, p = next(iter(hf.named_parameters()))
    cases = {
        "empty file": {},
        "wrong dtype": {name: p.detach().to(torch.float16)},
        "wrong shape": {name: torch.zeros(2, 2)},
        "unknown name": {"evil.weight": torch.zeros(2)},
        "integer tensor": {name: torch.zeros(p.shape, dtype=torch.int32)},
    }
    for what, tensors in cases.items():
        path = tmp_path / f"{what.replace(' ', '_')}.safetensors"
        save_file(tensors, str(path))
        r = post(server.url, "/request_weight_update", {"version": 13, "path": str(path)})
        assert r.status_code == 400, (what, r.status_code, r.text)
    pickle_path = tmp_path / "weights.pt"
    torch.save({name: p.detach()}, str(pickle_path))  # a pickle: must never be loaded
    r = post(server.url, "/request_weight_update", {"version": 13, "path": str(pickle_path)})
    assert r.status_code == 400 and "safetensors" in r.text
    for path in ("relative.safetensors", "/dev/null", "/nonexistent/x.safetensors", str(tmp_path)):
        assert post(server.url, "/request_weight_update", {"version": 13, "path": path}).status_code == 400, path
    assert fingerprint(server.url) == ref


def test_oversized_requests_are_refused(server, hf):
    ref = fingerprint(server.url)
    big = {"version": 14, "path": "/dev/shm/x.safetensors", "pad": "x" * (9 << 20)}  # over the 8 MiB default
    r = post(server.url, "/request_weight_update", big)
    assert r.status_code == 413 and "body" in r.json()["error"]["message"]
    r = post(server.url, "/v1/completions", {"model": "x", "prompt": "1" * (9 << 20)})
    assert r.status_code == 413
    n = sum(1 for _ in hf.parameters())
    many = [{"name": f"p{i}", "shape": [1], "dtype": "float32"} for i in range(n + 1)]
    r = post(server.url, "/request_weight_update", {"version": 14, "params": many})
    assert r.status_code == 413 and f"the model has {n} parameters" in r.text
    assert fingerprint(server.url) == ref


def test_process_group_to_a_port_the_caller_does_not_own(server):
    ref = fingerprint(server.url)
    base = {"rank_offset": 1, "world_size": 2, "timeout_s": 5}
    cases = {
        "third host": {"master_address": "198.51.100.7", "master_port": 29500},
        "privileged port": {"master_address": "127.0.0.1", "master_port": 22},
        "server's own port": {"master_address": "127.0.0.1", "master_port": server.port},
        "unresolvable": {"master_address": "no-such-host.invalid", "master_port": 29500},
    }
    for what, body in cases.items():
        r = post(server.url, "/init_process_group", {**base, **body})
        assert r.status_code == 403, (what, r.status_code, r.text)
        assert "master" in r.json()["error"]["message"], what
    assert "403 /init_process_group from 127.0.0.1" in server.log_tail(400)
    assert fingerprint(server.url) == ref


def test_master_address_rule():
    assert check_master_address("127.0.0.1", 29500, "127.0.0.1") == "127.0.0.1"
    assert check_master_address("localhost", 29500, "10.1.2.3") in ("127.0.0.1", "::1")
    assert check_master_address("10.1.2.3", 29500, "10.1.2.3") == "10.1.2.3"  # the caller's own host
    for addr, port, client in [("10.1.2.4", 29500, "10.1.2.3"), ("127.0.0.1", 80, "127.0.0.1"),
                               ("10.1.2.3", 1023, "10.1.2.3")]:
        with pytest.raises(ValueError):
            check_master_address(addr, port, client)
    with pytest.raises(ValueError, match="own port"):
        check_master_address("127.0.0.1", 8000, "127.0.0.1", own_port=8000)


def test_group_still_works_after_the_abuse(server, hf, sync):
    """The last test of the module: a good update after all the rejected ones is applied."""
    before = fingerprint(server.url)
    new = [(n, p.detach() + 0.05) for n, p in hf.named_parameters()]
    sync.push(new, version=21)
    after = fingerprint(server.url)
    assert after[2] == 21 and after[:2] != before[:2]


# ---- remote clients -----------------------------------------------------------------------------------------------
def _local_ips() -> list[str]:
    ips = set()
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            ips.add(info[4][0])
    except socket.gaierror:
        pass
    try:  # the address of the default route (no packet is sent)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.123", 9))
            ips.add(s.getsockname()[0])
    except OSError:
        pass
    return sorted(ips)


def test_admin_endpoints_refuse_remote_clients(tiny_model_dir):
    remote = [ip for ip in _local_ips() if not ip.startswith("127.")]
    if not remote:
        pytest.skip("this machine has no non-loopback IPv4 address")
    port = free_port()
    with ServerProcess(str(tiny_model_dir), port=port, host="0.0.0.0", extra_args=["--max-model-len", "64"],
                       env=ENV) as proc:
        url = f"http://{remote[0]}:{port}"
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200  # the API itself is reachable
        for path, body in [("/init_process_group", {"master_address": remote[0], "master_port": 29500,
                                                     "rank_offset": 1, "world_size": 2, "timeout_s": 5}),
                           ("/request_weight_update", {"version": 1, "path": "/dev/shm/x.safetensors"}),
                           ("/check_weight_update", {"version": 1, "path": "/dev/shm/x.safetensors"})]:
            r = httpx.post(url + path, json=body, timeout=10)
            assert r.status_code == 403, (path, r.status_code, r.text)
        assert f"403 /request_weight_update from {remote[0]}" in proc.log_tail(200)
