"""`inflight demo`: build the tiny model if it is missing, warm-start it with SFT, then pipelined RL on `arith`
with configs/cpu-demo.yaml; ends by printing where the report is."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from inflight.config import ConfigError, RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "cpu-demo.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="run config (default: configs/cpu-demo.yaml)")
    parser.add_argument("--rebuild", action="store_true", help="build and warm-start the model again")
    parser.add_argument("--sft-target", type=float, default=0.25, help="warm-start accuracy target (default 0.25)")
    parser.add_argument("--sft-steps", type=int, default=2000, help="warm-start step limit (default 2000)")
    parser.add_argument("--sft-wrong-frac", type=float, default=0.0,
                        help="share of wrong warm-start targets (default 0: the accuracy target alone stops it)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. pipeline.max_minutes=2")


def prepare_model(cfg: RunConfig, rebuild: bool = False, sft_target: float = 0.25, sft_steps: int = 2000,
                  sft_wrong_frac: float = 0.0) -> Path:
    """cfg.model.path holds the warm-started model; its random-init base sits next to it as <path>-base."""
    from inflight.modelkit.build import make_model  # lazy: start-up cost (torch, transformers): a fast --help
    from inflight.trainer.sft import warm_start  # lazy: start-up cost, as above

    warm = Path(cfg.model.path)
    base = warm.with_name(warm.name + "-base")
    if rebuild or not (base / "config.json").exists():
        print(f"demo: building a '{cfg.model.size}' model for {cfg.task.name} -> {base}")
        make_model(cfg.task, base, size=cfg.model.size, seed=cfg.seed)
    if rebuild or not (warm / "sft.json").exists():
        print(f"demo: warm start (SFT, {sft_wrong_frac:.0%} wrong targets) until held-out accuracy >= {sft_target:.0%}"
              f" -> {warm}")
        sft_cfg = dataclasses.replace(cfg.trainer, lr=3e-3)
        # accuracy jumps quickly once addition "clicks": evaluate often so the start lands near the target
        warm_start(base, warm, cfg.task, sft_cfg, wrong_frac=sft_wrong_frac, target_acc=sft_target,
                   max_steps=sft_steps, eval_every=10, seed=cfg.seed)
    info = json.loads((warm / "sft.json").read_text())
    print(f"demo: warm-started model {warm}: held-out accuracy {info['accuracy']:.1%}")
    return warm


def result_line(summary: dict) -> str:
    """The demo's last word, from the run's summary (accuracies in percent, None without an evaluation)."""
    def pct(key: str) -> str:
        return "n/a" if summary.get(key) is None else f"{summary[key]:.1f}%"

    line = (f"demo: held-out accuracy {pct('first_accuracy')} -> {pct('last_accuracy')} "
            f"(best {pct('best_accuracy')}) in {summary['wall_s']} s of RL")
    if summary.get("truncated_pct_last") is not None:  # a policy that learnt not to stop shows here
        line += (f"; at the end {summary['completion_len_last']:.1f} tokens per completion, "
                 f"{pct('truncated_pct_last')} cut off by max_new_tokens")
    return line


def run(args: argparse.Namespace) -> int:
    from inflight.pipeline.launch_common import run_dir_of  # lazy: start-up cost (torch): fast `--help`
    from inflight.pipeline.launcher import run_pipeline  # lazy: start-up cost, as above

    try:
        cfg = load_config(RunConfig, args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"inflight demo: {exc}", file=sys.stderr)
        return 2
    prepare_model(cfg, args.rebuild, args.sft_target, args.sft_steps, args.sft_wrong_frac)
    code = run_pipeline(cfg)
    report = run_dir_of(cfg) / "report.html"
    if code == 0:
        print(result_line(json.loads((run_dir_of(cfg) / "summary.json").read_text())[0]))
        print(f"demo: report at {report}")
    return code
