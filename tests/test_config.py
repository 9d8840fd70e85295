"""Configuration: YAML + dotted overrides, and one clear message per mistake."""

import pytest

from inflight.config import ConfigError, RunConfig, load_config, save_config


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 0.01\nactor:\n  max_lag: 3\n")
    cfg = load_config(RunConfig, path, ["actor.max_lag=5", "task.operators=[+,-]"])
    assert cfg.trainer.lr == 0.01
    assert cfg.actor.max_lag == 5  # the command line wins over the file
    assert cfg.task.operators == ["+", "-"]
    assert isinstance(cfg, RunConfig)


def test_unknown_key_names_it_and_the_closest_valid_one():
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, ["trainer.lrr=0.1"])
    assert str(err.value) == "unknown config key 'trainer.lrr'; did you mean 'trainer.lr'?"


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match=r"'actor.group_sise'.*'actor.group_size'"):
        load_config(RunConfig, path)


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, ["actor.max_lag=often"])
    msg = str(err.value)
    assert msg.startswith("bad value for config key 'actor.max_lag'")
    assert "often" in msg and "\n" not in msg


def test_override_without_equals():
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(RunConfig, None, ["trainer.lr"])


def test_resolved_config_is_written_and_reloads(tmp_path):
    cfg = load_config(RunConfig, None, ["name=abc", "trainer.lr=0.5"])
    path = save_config(cfg, tmp_path / "run")
    again = load_config(RunConfig, path)
    assert again == cfg


def test_startup_timeout_auto_by_engine():
    """pipeline.startup_timeout_s 0 = a default for the engine: vLLM / SGLang servers compile at start, several at
    once take longer; an explicit value always wins."""
    from inflight.backends import startup_timeout

    assert startup_timeout(load_config(RunConfig, None, [])) == 180.0
    assert startup_timeout(load_config(RunConfig, None, ["server.engine=vllm", "server.num_servers=4"])) == 780.0
    assert startup_timeout(load_config(RunConfig, None, ["trainer.protocol=sglang",
                                                         "pipeline.server_urls=[http://a:1,http://b:1]"])) == 660.0
    assert startup_timeout(load_config(RunConfig, None, ["server.engine=vllm", "pipeline.startup_timeout_s=30"])) == 30
