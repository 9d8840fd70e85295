"""`inflight train CONFIG.yaml [key=value ...]`: the whole RL pipeline from a YAML config (pipelined or sync)."""

from __future__ import annotations

import argparse
import sys

from inflight.config import ConfigError, RunConfig, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML file (see configs/ and docs/configuration.md)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-4 pipeline.mode=sync")


def run(args: argparse.Namespace) -> int:
    from inflight.pipeline.launcher import run_pipeline

    try:
        cfg = load_config(RunConfig, args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"inflight train: {exc}", file=sys.stderr)
        return 2
    try:
        return run_pipeline(cfg)
    except ValueError as exc:  # configuration checks of the launcher
        print(f"inflight train: {exc}", file=sys.stderr)
        return 2
