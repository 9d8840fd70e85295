"""The Ray launcher's configuration checks: they fail before anything starts, with a message that says what to
set (no Ray cluster needed)."""

from __future__ import annotations

import pytest

from inflight.config import RunConfig, load_config
from inflight.pipeline.ray_launcher import check_ray_config


def cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["pipeline.launcher=ray", "pipeline.stream=redis", "server.api_key=k",
                                         "server.num_servers=2", *overrides])


def test_valid_config_returns_the_key(monkeypatch):
    monkeypatch.delenv("INFLIGHT_API_KEY", raising=False)
    assert check_ray_config(cfg("pipeline.ray_resources={server1: node_b, trainer: 'node:10.0.0.1'}")) == "k"
    monkeypatch.setenv("INFLIGHT_API_KEY", "from-env")
    assert check_ray_config(cfg("server.api_key=''")) == "from-env"


@pytest.mark.parametrize("override, message", [
    ("pipeline.stream=memory", "needs pipeline.stream=redis"),
    ("server.api_key=''", "needs an API key"),
    ("pipeline.server_urls=[http://x:1]", "leave pipeline.server_urls empty"),
    ("pipeline.ray_resources={server2: node_b}", "unknown roles ['server2']"),
    ("server.engine=vllm", "server.engine=builtin only"),
])
def test_bad_config_is_refused(monkeypatch, override, message):
    monkeypatch.delenv("INFLIGHT_API_KEY", raising=False)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_ray_config(cfg(override))


def test_unknown_launcher_is_refused():
    from inflight.pipeline.launcher import run_pipeline

    with pytest.raises(ValueError, match="pipeline.launcher must be 'local' or 'ray'"):
        run_pipeline(cfg("pipeline.launcher=slurm"))
