"""The registry of inference backends (inflight/backends.py): the shipped three, a fourth registered from its own
module (tests/toy_backend.py) through INFLIGHT_BACKENDS, and what every role gets from it."""

from __future__ import annotations

import sys

import pytest

from inflight import backends
from inflight.backends import startup_timeout
from inflight.config import RunConfig, load_config
from inflight.pipeline.launch_common import check_config, engine_options, server_command


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setenv(backends.ENV, "tests.toy_backend")
    yield backends.get("toy")
    backends.unregister("toy")  # the next test sees the shipped registry again
    backends._LOADED.discard("tests.toy_backend")
    sys.modules.pop("tests.toy_backend", None)


def test_the_shipped_backends_and_their_parts():
    assert backends.names()[:3] == ["builtin", "vllm", "sglang"]
    assert list(backends.protocols())[:3] == ["inflight", "vllm", "sglang"]
    builtin = backends.get("builtin")
    assert builtin.launcher is None and builtin.restartable and builtin.quick_start
    for name in ("vllm", "sglang"):
        b = backends.get(name)
        assert backends.resolve(b.launcher).__module__ == f"inflight.engine.{name}_backend.launcher"
        assert b.protocol == name and hasattr(backends.resolve(b.protocol_module), "make_client")
    with pytest.raises(ValueError, match=r"unknown inference backend 'tgi'; choose one of builtin, vllm or sglang.*"
                                         r"INFLIGHT_BACKENDS"):
        backends.get("tgi")
    with pytest.raises(ValueError, match="unknown trainer.protocol 'tgi'; choose one of inflight, vllm, sglang"):
        backends.protocol_module("tgi")


def test_a_name_registered_twice_is_refused():
    vllm = backends.get("vllm")
    assert backends.register(vllm) is vllm  # the same registration again (a module imported twice) is fine
    with pytest.raises(ValueError, match="'vllm' is registered twice"):
        backends.register(backends.InferenceBackend(name="vllm", launcher=None, options="m:f", protocol="p",
                                                    protocol_module="m", adapter="m:f"))
    assert backends.get("vllm") is vllm


def test_a_plugin_module_that_does_not_import_is_named(monkeypatch):
    monkeypatch.setenv(backends.ENV, "tests.no_such_backend")
    with pytest.raises(ValueError, match="INFLIGHT_BACKENDS names 'tests.no_such_backend'"):
        backends.names()


def test_a_registered_backend_reaches_every_role(toy, tiny_model_dir, tmp_path):
    """Config checks, the server's command line (its own option names), the trainer's protocol and the actor's
    adapter all come from the one registration."""
    from inflight.actor.response_parsers import get_adapter
    from inflight.trainer.weight_sync import make_weight_sync
    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    assert backends.names() == ["builtin", "vllm", "sglang", "toy"]
    cfg = load_config(RunConfig, None, [f"model.path={tiny_model_dir}", "server.engine=toy", "trainer.protocol=toy",
                                        "actor.adapter=toy", "server.max_batch=5", "server.max_model_len=200",
                                        f"pipeline.run_dir={tmp_path}"])
    check_config(cfg)
    assert engine_options(cfg.server, cuda=False) == ["--engine", "toy", "--toy-slots", "5", "--toy-context", "200"]
    assert server_command(cfg, 0)[1:4] == ["-m", "inflight.cli", "serve"]
    assert startup_timeout(cfg) == 600.0  # not a quick starter: the stock default
    assert get_adapter("toy") is toy_module().parse
    client = make_weight_sync(cfg, ["http://127.0.0.1:1"])
    try:
        assert type(client) is WeightSyncClient and client.transport == "process_group"
    finally:
        client.close()
    with pytest.raises(ValueError, match="trainer.protocol=toy sends weights over a process group only"):
        make_weight_sync(load_config(RunConfig, None, ["trainer.protocol=toy", "trainer.weight_transport=shm"]),
                         ["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="server.engine must be builtin, vllm, sglang or toy, got 'tgi'"):
        check_config(load_config(RunConfig, None, [f"model.path={tiny_model_dir}", "server.engine=tgi"]))


def toy_module():
    return sys.modules["tests.toy_backend"]
