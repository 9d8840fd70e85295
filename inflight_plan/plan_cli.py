"""`inflight plan CONFIG.yaml --gpus N --profile PROFILE.json [key=value ...]`: how to split N devices between
inference servers and the trainer, and how much faster pipelined is than sync, predicted by simulation
(inflight_plan/sim.py) on a measured or published profile. Every figure printed is a prediction from that profile.

The loop's settings (group size, groups per step, max_lag, update mode, max_batch, num_grad_steps, queue_ahead)
come from the config; the completion lengths from --lengths (a distribution) or --lengths-from (a file of integers,
e.g. the lengths of a real run); the share of the trainer's forward tokens back-propagated (it skips zero-advantage
groups) from --trained-frac.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from inflight.config import ConfigError, RunConfig, load_config
from inflight_plan.runs import read_run
from inflight_plan.workload import Lengths, from_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.max_lag=4")
    parser.add_argument("--gpus", type=int, required=True, help="devices to split between servers and trainer")
    parser.add_argument("--profile", required=True, help="profile JSON (inflight profile, or inflight_plan/profiles/)")
    parser.add_argument("--gpus-per-server", type=int, default=0, help="devices per server (default: the profile's)")
    parser.add_argument("--lengths", default="", help="fixed:N | uniform:A:B | lognormal:MEDIAN:SIGMA:MAX "
                                                      "(default lognormal, median max_new_tokens/4, cut at the limit)")
    parser.add_argument("--lengths-from", default="",
                        help="a run folder (its metrics.jsonl) or a file of completion lengths (integers)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per sample")
    parser.add_argument("--trained-frac", type=float, default=1.0,
                        help="share of the forward tokens (each group's prompt once, every completion) back-propagated")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps simulated per set-up")
    parser.add_argument("--samples", type=int, default=0, help="also print the predicted time to train this many")
    parser.add_argument("--plot", default="", help="write a plot (PNG) of samples/s per split and the lag histogram")
    parser.add_argument("--json", default="", help="write the predictions as JSON")


def _lengths(args: argparse.Namespace, max_new: int):
    if args.lengths_from and Path(args.lengths_from).is_dir():  # a run folder: the lengths its steps recorded
        return Lengths(values=read_run(args.lengths_from)["lengths"])
    if args.lengths_from:
        vals = [int(v) for v in re.findall(r"\d+", Path(args.lengths_from).read_text())]
        if not vals:
            raise ValueError(f"{args.lengths_from}: no integers in it")
        return Lengths(values=vals)
    return Lengths(args.lengths or f"lognormal:{max(1, max_new // 4)}:1.0:{max_new}")


def run(args: argparse.Namespace) -> int:
    from inflight_plan import split  # lazy: it imports Profile (pydantic, ~0.3 s); `plan --help` needs neither
    from inflight_plan.profile import Profile  # lazy: pydantic (~0.3 s); `plan --help` answers without it

    try:
        cfg = load_config(RunConfig, args.config, args.overrides)
        profile = Profile.load(args.profile)
        lengths = _lengths(args, cfg.actor.max_new_tokens)
        per = args.gpus_per_server or profile.engine.devices
        base = from_run_config(cfg, lengths, steps=args.steps, prompt_tokens=args.prompt_tokens,
                               trained_frac=args.trained_frac, mode="pipelined",
                               max_batch=min(cfg.server.max_batch, profile.engine.max_batch))
        split.candidates(args.gpus, per)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"inflight plan: {exc}", file=sys.stderr)
        return 2
    pipe, pipe_all = split.best(profile, base, args.gpus, "pipelined", per)
    sync, sync_all = split.best(profile, base, args.gpus, "sync", per)
    coloc = split.colocated(profile, base, args.gpus, per)
    print(f"PREDICTION (simulated; not measured) from profile {args.profile}:\n  {profile.source}")
    c = base
    print(f"workload: groups of {c.group_size} x {c.groups_per_step} per step, max_lag {c.max_lag} "
          f"({c.update_mode}), sync num_grad_steps {c.num_grad_steps}, max_batch {c.max_batch}, mean completion "
          f"{lengths.mean():.0f} tokens, prompt {c.prompt_tokens}, trained share {c.trained_frac:.0%}; {args.gpus} "
          f"devices, {per} per server; {args.steps} steps each")
    print(f"{'set-up':<16} {'servers':>7} {'trainer':>7} {'samples/s':>10} {'s/step':>8} {'server busy':>11} "
          f"{'batch':>6} {'trainer busy':>12}  lag histogram (share of tokens)")
    rows = [("pipelined", pipe), ("sync (split)", sync), ("sync colocated", coloc)]
    for name, ch in rows:
        r = ch.result
        busy = sum(r.server_busy) / len(r.server_busy)
        lag = " ".join(f"{k}:{v:.2f}" for k, v in r.lag_share().items())
        print(f"{name:<16} {ch.servers:>7} {ch.trainer_devices:>7} {ch.samples_per_s:>10.2f} "
              f"{r.seconds_per_step:>8.2f} {busy:>11.0%} {r.server_mean_batch:>6.1f} {r.trainer_busy:>12.0%}  {lag}")
    if args.samples > 0:
        print(f"predicted time to {args.samples} samples: " + ", ".join(
            f"{name} {split.time_to(ch.result, args.samples) / 3600:.2f} h" for name, ch in rows))
    best_sync = max(sync, coloc, key=lambda ch: ch.samples_per_s)
    ratio = pipe.samples_per_s / best_sync.samples_per_s
    print(f"best split: {pipe.servers} server(s) x {per} + {pipe.trainer_devices} trainer device(s); predicted "
          f"pipelined / best sync ({best_sync.label}): {ratio:.2f}x samples/s")
    if args.plot:
        split.plot(args.plot, pipe_all, sync_all, coloc, args.gpus, profile.source)
        print(f"plot written to {args.plot}")
    if args.json:
        out = {"prediction": True, "profile": args.profile, "source": profile.source, "ratio": ratio,
               "setups": {name: {"servers": ch.servers, "trainer_devices": ch.trainer_devices,
                                 "samples_per_s": ch.samples_per_s, "lag": ch.result.lag_share()}
                          for name, ch in rows}}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0
