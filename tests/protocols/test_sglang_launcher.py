"""`inflight serve --engine sglang`: the SGLang command line it builds, and the error without SGLang installed."""

import importlib.util
import subprocess
import sys

import pytest

from inflight.engine.serve import strip_engine_flag
from inflight.engine.sglang_backend.launcher import build_command, parse


def test_command_maps_options_and_passes_the_rest():
    args, rest = parse(["--model", "/m", "--port", "9001", "--dtype", "bfloat16", "--api-key", "k",
                        "--tp-size", "2", "--mem-fraction-static=0.7"])
    cmd = build_command(args, rest, python="/py")
    assert cmd == ["/py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
                   "--port", "9001", "--log-level", "info", "--dtype", "bfloat16", "--api-key", "k",
                   "--disable-radix-cache", "--tp-size", "2", "--mem-fraction-static=0.7"]


def test_radix_cache_kept_on_request_and_not_doubled():
    args, rest = parse(["--model", "/m", "--enable-radix-cache"])
    assert "--disable-radix-cache" not in build_command(args, rest)
    args, rest = parse(["--model", "/m", "--disable-radix-cache"])
    assert build_command(args, rest).count("--disable-radix-cache") == 1


def test_strip_engine_flag():
    assert strip_engine_flag(["--engine", "sglang", "--model", "/m", "--engine=sglang"]) == ["--model", "/m"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_clear_error_without_sglang(tmp_path):
    r = subprocess.run([sys.executable, "-m", "inflight.cli", "serve", "--engine", "sglang", "--model", str(tmp_path),
                        "--tp-size", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--engine sglang needs SGLang in this Python environment" in r.stderr
