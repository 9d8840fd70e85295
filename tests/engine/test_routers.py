"""The server's routers reused by another backend: the vLLM launcher's app (engine/vllm_backend/launcher.py
`build_app`) assembled over the built-in engine and its receiver (the same surface as VLLMEngine and
VLLMWeightReceiver), so it runs here without vLLM. Every route once, one set of access rules on all of them."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from fastapi.testclient import TestClient

from inflight.config.engine import EngineSettings
from inflight.engine.api.server import create_app
from inflight.engine.core import InferenceEngine
from inflight.engine.vllm_backend.launcher import build_app
from inflight.engine.weights.receiver import WeightReceiver

torch.set_num_threads(1)
KEY = {"Authorization": "Bearer k"}
ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/init_process_group",
          "/request_weight_update", "/check_weight_update"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return InferenceEngine(str(tiny_model_dir), max_batch=4, max_model_len=128)


def _paths(routes) -> Counter:
    """Every served path (FastAPI >= 0.165 keeps an included router as one entry: its routes are counted)."""
    found: Counter = Counter()
    for r in routes:
        if hasattr(r, "original_router"):
            found += _paths(r.original_router.routes)
        elif not getattr(r, "path", "/docs").startswith(("/docs", "/openapi", "/redoc")):
            found[r.path] += 1
    return found


def test_builtin_and_vllm_apps_serve_the_same_routes_once(engine):
    builtin = create_app(engine, EngineSettings(api_key="k"), manage_engine=False)
    vllm = build_app(engine, WeightReceiver(engine), EngineSettings(api_key="k"))
    for app in (builtin, vllm):
        paths = _paths(app.router.routes)
        assert set(paths) == ROUTES and max(paths.values()) == 1, paths


def test_reused_routers_keep_the_access_rules(engine):
    receiver = WeightReceiver(engine)
    app = build_app(engine, receiver, EngineSettings(api_key="k"))
    spec = [{"name": n, "shape": list(s), "dtype": "float32"} for n, (s, _) in engine.param_specs().items()]
    update = {"version": 1, "params": spec[:1]}
    with TestClient(app) as local:
        assert local.get("/health").status_code == 200  # open: the launcher's start-up wait sends no key
        for method, path in [("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/check_weight_update"),
                             ("POST", "/init_process_group"), ("POST", "/v1/chat/completions")]:
            assert local.request(method, path, json={}).status_code == 401, path
        metrics = local.get("/metrics", headers=KEY)
        assert metrics.status_code == 200 and "inflight_weight_updates_total 0" in metrics.text
        r = local.post("/check_weight_update", json=update, headers=KEY)  # the receiver answers
        assert r.status_code == 409 and "POST /init_process_group first" in r.json()["error"]["message"]
        chat = local.post("/v1/chat/completions", headers=KEY, json={
            "model": engine.model_name, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 3,
            "temperature": 0, "logprobs": True})
        assert chat.status_code == 200 and len(chat.json()["choices"][0]["token_ids"]) == 3
    with TestClient(app, client=("10.1.2.3", 5000)) as remote:  # admin routes: local clients only
        r = remote.post("/check_weight_update", json=update, headers=KEY)
        assert r.status_code == 403 and "local clients only" in r.json()["error"]["message"]
        assert remote.get("/metrics", headers=KEY).status_code == 200
