"""`inflight serve --engine sglang --model DIR [SGLang server options]`: start a stock SGLang server
(`python -m sglang.launch_server`) for `trainer.protocol: sglang` and `actor.adapter: sglang`.

SGLang serves the OpenAI API and its own weight-update routes itself; inflight adds nothing inside the server.
What this launcher does: maps our option names onto SGLang's (`--model` -> `--model-path`), binds to localhost by
default, and turns the radix (prefix) cache off unless `--enable-radix-cache` is given: a prefix cached by old
weights would be reused after an update (the same reason the vLLM backend turns prefix caching off).
Options we do not know go to SGLang unchanged (`--tp-size`, `--mem-fraction-static`, `--context-length`, ...).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="folder (or hub id) of the model: SGLang's --model-path")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default=None, help="SGLang's --dtype (auto, float32, bfloat16, ...)")
    p.add_argument("--api-key", default=os.environ.get("INFLIGHT_API_KEY") or None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--enable-radix-cache", action="store_true",
                   help="keep SGLang's prefix cache (faster; a cached prefix may predate the last weight update)")
    p.add_argument("--log-level", default="info")


def build_command(args: argparse.Namespace, sglang_argv: list[str], python: str | None = None) -> list[str]:
    """The argv of `python -m sglang.launch_server` for these options."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
           "--host", args.host, "--port", str(args.port), "--log-level", args.log_level]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    if not args.enable_radix_cache and "--disable-radix-cache" not in sglang_argv:
        cmd.append("--disable-radix-cache")
    return cmd + list(sglang_argv)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="inflight serve --engine sglang", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, sglang_argv = parse(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("sglang") is None:
        raise SystemExit("--engine sglang needs SGLang in this Python environment (pip install 'sglang[all]'); "
                         "run inflight from SGLang's environment (pip install --no-deps -e . there; "
                         "docs/backends.md)")
    cmd = build_command(args, sglang_argv)
    os.execv(cmd[0], cmd)  # the server replaces us: signals and exit status are SGLang's own
    return 0  # not reached
