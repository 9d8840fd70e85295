"""`inflight make-model --task arith OUT_DIR [--size tiny|small] [overrides]`."""

from __future__ import annotations

import argparse
import json
import time

from inflight.config import RunConfig, load_config
from inflight.modelkit.build import SIZES, make_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write the model and tokenizer to")
    p.add_argument("--task", help="task whose text trains the tokenizer (default: the config's task.name)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="tiny ~0.6M (default), small ~6.4M, micro ~0.09M (tests) parameters")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--vocab-size", type=int, default=512, help="maximum BPE vocabulary (digits stay single)")
    p.add_argument("--config", help="YAML run config; its task section describes the task")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. task.digits=3")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(RunConfig, args.config, args.overrides)
    if args.task:
        cfg.task.name = args.task
    t0 = time.perf_counter()
    out = make_model(cfg.task, args.out_dir, size=args.size, seed=args.seed, vocab_size=args.vocab_size)
    info = json.loads((out / "inflight_model.json").read_text())
    print(f"built {args.size} model ({info['parameters']:,} parameters, vocabulary {info['vocab_size']}) "
          f"for task {cfg.task.name} in {time.perf_counter() - t0:.1f} s -> {out}")
    return 0
