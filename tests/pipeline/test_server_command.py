"""The launcher's server command lines (pipeline/launch_common.py `server_command`): each engine gets options its
own parser takes. The built-in line is parsed here by `inflight serve`'s parser; the vLLM line by our vLLM launcher's
parser, leaving only vLLM engine arguments (vLLM's own parser reads them in tests/vllm/test_vllm_pipeline.py)."""

from __future__ import annotations

import argparse
import sys

import pytest

from inflight.config import RunConfig, load_config
from inflight.engine import serve
from inflight.engine.serve import strip_engine_flag
from inflight.pipeline.launch_common import check_config, server_command

BUILTIN_ONLY = {"--max-batch", "--max-tokens-per-step", "--threads", "--device", "--generator-precision",
                "--no-prefix-reuse"}


def cfg_of(*overrides: str):
    return load_config(RunConfig, None, ["model.path=/m", "server.base_port=9000", *overrides])


def test_builtin_line_parses_with_serve():
    cfg = cfg_of("server.max_batch=7", "server.max_tokens_per_step=99", "server.threads=3",
                 "pipeline.server_devices=[0]", "server.extra_args=[--max-waiting,5]")
    argv = server_command(cfg, 0)
    assert argv[:4] == [sys.executable, "-m", "inflight.cli", "serve"]  # ray_roles.py drops these four
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(argv[4:])
    assert (args.engine, args.port, args.max_batch, args.max_tokens_per_step, args.threads, args.device,
            args.max_waiting, args.prefix_reuse) == ("builtin", 9000, 7, 99, 3, "cuda", 5, True)
    off = p.parse_args(server_command(cfg_of("server.prefix_reuse=false"), 0)[4:])
    assert off.prefix_reuse is False


def test_vllm_line_maps_the_builtin_flags():
    from inflight.engine.vllm_backend.launcher import add_arguments

    cfg = cfg_of("server.engine=vllm", "server.python=/venv/bin/python", "server.max_batch=7",
                 "server.max_tokens_per_step=99", "server.threads=3", "server.max_model_len=300",
                 "pipeline.server_devices=[0,1]", "server.api_key=k",
                 "server.extra_args=[--gpu-memory-utilization,0.5,--tensor-parallel-size,2,--max-num-seqs=9]")
    argv = server_command(cfg, 1)
    assert argv[:4] == ["/venv/bin/python", "-m", "inflight.cli", "serve"]
    assert argv[argv.index("--engine") + 1] == "vllm"
    assert not BUILTIN_ONLY & set(argv)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args, vllm_argv = p.parse_known_args(strip_engine_flag(argv[4:]))
    assert (args.model, args.port, args.api_key) == ("/m", 9001, "k")
    assert vllm_argv == ["--dtype", "float32", "--max-model-len", "300", "--max-num-seqs", "7",
                         "--max-num-batched-tokens", "99", "--gpu-memory-utilization", "0.5",
                         "--tensor-parallel-size", "2", "--max-num-seqs=9"]  # extra_args last: they win


def test_sglang_line_has_no_builtin_flags():
    argv = server_command(cfg_of("server.engine=sglang", "server.max_model_len=300"), 0)
    assert not BUILTIN_ONLY & set(argv)
    assert argv[argv.index("--context-length") + 1] == "300"


@pytest.mark.parametrize("override, message", [
    ("server.engine=vlm", "server.engine must be builtin, vllm or sglang"),
    ("server.python=/no/such/python", "server.python '/no/such/python' does not exist"),
])
def test_bad_server_settings_are_named(tmp_path, override, message):
    cfg = load_config(RunConfig, None, [f"model.path={tmp_path}", "pipeline.max_steps=1", override])
    with pytest.raises(ValueError, match=message):
        check_config(cfg)


def test_fsdp2_groups_must_split_evenly_over_ranks(tiny_model_dir):
    cfg = load_config(RunConfig, None, [f"model.path={tiny_model_dir}", "pipeline.max_steps=1",
                                        "trainer.backend=fsdp2", "trainer.num_processes=4",
                                        "actor.groups_per_step=6"])
    with pytest.raises(ValueError, match=r"actor.groups_per_step \(6\) must be a multiple of "
                                         r"trainer.num_processes \(4\)"):
        check_config(cfg)
    cfg.actor.groups_per_step = 8
    check_config(cfg)


def test_oversubscribed_servers_warn_with_the_numbers(tiny_model_dir, caplog):
    """The actor's sequences in flight (requests x sequences each x servers, capped by the staleness bound)
    against the servers' total max_batch: a warning naming both, none once they fit."""
    cfg = load_config(RunConfig, None, [f"model.path={tiny_model_dir}", "pipeline.max_steps=1",
                                        "server.num_servers=4", "server.max_batch=256", "actor.group_size=8",
                                        "actor.groups_per_step=64", "actor.max_lag=4",
                                        "actor.concurrency_per_server=128", "actor.max_new_tokens=1024"])
    with caplog.at_level("WARNING", logger="inflight.pipeline.launch_common"):
        check_config(cfg)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "up to 3072 sequences in flight" in msg and "128 x 8 sequences per request x 4 servers = 4096" in msg
    assert "decode 1024 at once (server.max_batch 256 x 4 servers)" in msg and "to 32" in msg
    assert "queue for up to 2048 decode steps" in msg  # 3072 in flight: 2 rounds of 1024 tokens wait
    caplog.clear()
    cfg.actor.max_new_tokens = 12  # the CPU demo's short completions: a queue of 2 rounds is 24 steps, no warning
    with caplog.at_level("WARNING", logger="inflight.pipeline.launch_common"):
        check_config(cfg)
    assert not caplog.records
    cfg.actor.max_new_tokens = 1024
    cfg.actor.concurrency_per_server = 32  # 32 x 8 x 4 = 1024: fits
    with caplog.at_level("WARNING", logger="inflight.pipeline.launch_common"):
        check_config(cfg)
    assert not caplog.records


def test_shipped_gpu_config_fits_its_servers(caplog):
    """And the shipped CPU configs, whose short completions queue a few dozen steps at most, print nothing."""
    from pathlib import Path

    from inflight.pipeline.launch_common import warn_oversubscribed

    for name in ("gpu-qwen2.5-gsm8k", "cpu-demo", "cpu-smollm2", "cpu-arith-tool", "bench-scratch"):
        cfg = load_config(RunConfig, Path(__file__).parents[2] / "configs" / f"{name}.yaml", [])
        with caplog.at_level("WARNING", logger="inflight.pipeline.launch_common"):
            warn_oversubscribed(cfg)
        assert not caplog.records, name
