"""One declaration of the built-in engine's settings (inflight/config/engine.py `EngineSettings`): `inflight serve`'s
options are generated from it, the launcher's command line comes from it and parses back to it, and a YAML value
reaches the engine object."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from inflight.config import RunConfig, load_config
from inflight.config.engine import TOOL_CALL_PARSERS, EngineSettings, ServerConfig, flag, from_args
from inflight.engine import serve
from inflight.engine.api.tool_parser import PARSERS
from inflight.engine.builtin_backend import options
from inflight.engine.core import InferenceEngine
from inflight.pipeline.launch_common import server_command

torch.set_num_threads(1)
FIELDS = {f.name: f for f in dataclasses.fields(EngineSettings)}


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p


def test_every_setting_is_a_serve_option_with_its_default_and_choices(monkeypatch):
    monkeypatch.delenv("INFLIGHT_API_KEY", raising=False)
    actions = {a.dest: a for a in serve_parser()._actions if a.dest != "help"}
    assert set(actions) - set(FIELDS) == set(serve.SERVE_ONLY)  # no option without a field but the documented ones
    for name, f in FIELDS.items():
        action = actions[name]
        assert action.option_strings[0] == flag(name) == "--" + name.replace("_", "-")
        assert action.default == f.default, name
        assert tuple(action.choices or ()) == f.metadata["choices"], name
        assert f.metadata["help"].replace("%", "%%") in action.help, name
    assert set(TOOL_CALL_PARSERS) == {"auto", "none", *PARSERS}  # what the chat route reads replies with


def test_every_value_the_engine_takes_the_option_takes():
    p = serve_parser()
    for name, f in FIELDS.items():
        for value in f.metadata["choices"]:
            assert getattr(p.parse_args(["--model", "m", flag(name), value]), name) == value
            EngineSettings(**{name: value})
    args = p.parse_args(["--model", "m", "--dtype", "float16"])  # refused before settings were declared once
    assert from_args(args).dtype == "float16"
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--dtype", "float64"])
    with pytest.raises(ValueError, match="server.dtype must be one of float32, bfloat16 or float16"):
        EngineSettings(dtype="float64")
    with pytest.raises(ValueError, match="low_priority_prefill must be >= 1"):  # checked once, for YAML and flags
        from_args(p.parse_args(["--model", "m", "--low-priority-prefill", "0"]))


def test_the_launchers_options_parse_back_to_the_same_settings():
    """Every setting away from its default: the launcher's line (builtin_backend.options) read by serve's parser
    gives the settings back, field for field."""
    changed = dict(dtype="bfloat16", generator_precision="int8", max_batch=7, max_model_len=99, max_tokens_per_step=11,
                   low_priority_prefill=5, low_priority_seqs=3, prefix_reuse=False, cuda_graphs="off", threads=2,
                   chat_template="chatml_tools", tool_call_parser="hermes", api_key="k", allow_remote_admin=True,
                   max_waiting=4, max_body_bytes=1000, header_timeout_s=1.5, body_timeout_s=2.5,
                   reject_nonfinite=False, version_wait_s=9.0)
    assert set(changed) == set(FIELDS)  # a new setting: add it here
    s = ServerConfig(**changed)
    argv = options(s, cuda=False)
    assert "--api-key" not in argv  # server_argv gives every backend's launcher the key
    args = serve_parser().parse_args(["--model", "m", "--api-key", "k", *argv])
    assert dataclasses.asdict(from_args(args)) == changed
    assert options(ServerConfig(), cuda=True) == ["--device", "cuda"]  # defaults: nothing to say


def test_a_yaml_setting_reaches_the_engine(tiny_model_dir, tmp_path):
    """YAML -> the launcher's `inflight serve` line -> serve's parser -> build_app: the engine and the app hold the
    values (YAML's bare `on` is a boolean, which cuda_graphs reads as on)."""
    yaml = tmp_path / "run.yaml"
    yaml.write_text(f"model:\n  path: {tiny_model_dir}\nserver:\n  cuda_graphs: on\n  max_batch: 3\n"
                    "  max_model_len: 64\n  low_priority_seqs: 2\n  max_waiting: 5\n  prefix_reuse: false\n")
    cfg = load_config(RunConfig, yaml)
    argv = server_command(cfg, 0)
    assert argv[argv.index("--cuda-graphs") + 1] == "on"
    app = serve.build_app(serve_parser().parse_args(argv[4:]))  # the process `inflight serve` would be
    engine = app.state.receiver.engine
    assert engine.graphs is not None and engine.graphs.status == "eager replay"  # cuda_graphs on, on CPU
    assert (engine.max_batch, engine.max_model_len, engine.low_priority_seqs) == (3, 64, 2)
    assert engine._slots.reuse is False and app.state.admission.max_waiting == 5
    # in-process, the same object: a ServerConfig is the engine's settings
    direct = InferenceEngine(str(tiny_model_dir), cfg.server)
    assert direct.graphs is not None and (direct.max_batch, direct.low_priority_seqs) == (3, 2)
