"""`inflight train CONFIG.yaml [key=value ...]`: the whole RL pipeline from a YAML config (pipelined or sync).
`inflight train --resume RUN_DIR [key=value ...]`: continue a run from its newest checkpoint, with the config it
saved (overrides still apply, e.g. a higher pipeline.max_steps or new ports)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inflight.config import ConfigError, RunConfig, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML file (see configs/ and docs/configuration.md)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-4 pipeline.mode=sync")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR (runs/<name>) from its "
                        "newest checkpoint; its config.yaml is the config")


def resume_config(run_dir: str, overrides: list[str]) -> RunConfig:
    """The run's saved config, with its run folder pinned to RUN_DIR (wherever it was moved)."""
    path = Path(run_dir)
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"{path / 'config.yaml'} not found: is {run_dir} a run folder (runs/<name>)?")
    pinned = [f"name={path.resolve().name}", f"pipeline.run_dir={path.resolve().parent}"]
    return load_config(RunConfig, path / "config.yaml", [*overrides, *pinned])


def run(args: argparse.Namespace) -> int:
    from inflight.pipeline.launcher import run_pipeline  # lazy: start-up cost (torch): a fast `train --help`

    try:
        if args.resume:
            overrides = ([args.config] if args.config else []) + list(args.overrides)  # no YAML with --resume
            cfg = resume_config(args.resume, overrides)
        elif args.config is None:
            raise ConfigError("give a CONFIG.yaml, or --resume RUN_DIR")
        else:
            cfg = load_config(RunConfig, args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"inflight train: {exc}", file=sys.stderr)
        return 2
    try:
        return run_pipeline(cfg, resume=bool(args.resume))
    except ValueError as exc:  # configuration checks of the launcher
        print(f"inflight train: {exc}", file=sys.stderr)
        return 2
