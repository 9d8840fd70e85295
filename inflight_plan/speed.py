"""How fast this machine runs now, against when a profile was measured: a short re-measurement of two of the
profile's own points (the trainer's step on the profile's shape, the built-in engine's decode step at one batch).

A shared VM's speed drifts: on a 2-core VM (2026-12-03) the same config's trainer computed 10.4k, 8.7k and
6.6k forward tokens/s at different hours, and two profiles of the same machine 20 minutes apart moved predictions by
up to 40%. A profile predicts a run made at another time only as far as the machine kept its speed, so
bench/plan_check.py measures this index next to each run and predicts the run from the profile rescaled by it
(`rescaled`): the check then tests the model of the loop, not the machine's drift. Nothing is read from the run.

    python -m inflight_plan.speed CONFIG.yaml [key=value ...] --profile PROFILE.json [--out INDEX.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from inflight.config import RunConfig, load_config
from inflight_plan.contention import slowed
from inflight_plan.measure import measure_engine, trainer_bench
from inflight_plan.profile import Profile


def index_point(profile: Profile, batch_hint: int) -> tuple[int, int]:
    """(batch, context) of the profile's decode grid the index re-measures: the grid batch nearest a step's batch,
    at the first context (a grid point, so that the profile holds the same measurement)."""
    d = profile.engine.decode
    return min(d.batches, key=lambda b: (abs(b - batch_hint), b)), d.contexts[0]


def measure_index(cfg, profile: Profile, steps: int = 4, repeats: int = 3) -> dict:
    """The two points, measured as `inflight profile` measures them (measure.py), fewer times. `cfg`: RunConfig."""
    t = profile.trainer
    if not t.completion_tokens:
        raise ValueError("the profile does not record the trainer's shape: measure it again with `inflight profile`")
    step, tokens = trainer_bench(cfg.model.path, cfg.trainer, t.group_size or cfg.actor.group_size,
                                 cfg.actor.groups_per_step, t.prompt_tokens, t.completion_tokens)
    step()  # warm-up
    backward = statistics.median(step()[0] for _ in range(steps))
    batch, context = index_point(profile, cfg.actor.group_size * cfg.actor.groups_per_step)
    engine, _ = measure_engine(cfg.model.path, [batch], [context], threads=cfg.server.threads,
                               precision=cfg.server.generator_precision, repeats=repeats,
                               max_batch=profile.engine.max_batch,
                               # an older profile's engine was sized for its grid: the longest context + 40 + 8
                               max_model_len=profile.engine.max_model_len or max(profile.engine.decode.contexts) + 48)
    return {"trainer_tokens_per_s": tokens / backward, "decode_step_s": engine.decode.step_s[0][0],
            "batch": batch, "context": context,
            "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}


def ratios(profile: Profile, indexes: list[dict]) -> tuple[float, float]:
    """(trainer, engine): how many times faster each ran at the indexes (their geometric mean) than in the profile."""
    gmean = statistics.geometric_mean
    trainer = gmean([i["trainer_tokens_per_s"] for i in indexes]) / profile.trainer.tokens_per_s
    step = profile.engine.decode.step_time(indexes[0]["batch"], indexes[0]["context"])
    engine = step / gmean([i["decode_step_s"] for i in indexes])
    return trainer, engine


def rescaled(profile: Profile, trainer: float, engine: float) -> Profile:
    """The profile on a machine `trainer` / `engine` times as fast: the trainer's rate, optimizer step, push and
    stream reads by the trainer's ratio; the decode curve, prefill, pause and the server's and actor's reply work
    (Python on the same cores) by the engine's."""
    out = slowed(profile, 1 / trainer, 1 / engine, 1 / engine)
    return out.model_copy(update={
        "source": f"{profile.source}; rescaled by a speed index (trainer x{trainer:.2f}, engine x{engine:.2f})"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--profile", required=True, help="the profile whose points are re-measured")
    ap.add_argument("--out", default="", help="write the index here (JSON)")
    args = ap.parse_args(argv)
    cfg = load_config(RunConfig, args.config, args.overrides)
    profile = Profile.load(args.profile)
    index = measure_index(cfg, profile)
    trainer, engine = ratios(profile, [index])
    print(f"speed index: trainer {index['trainer_tokens_per_s']:.0f} tok/s ({trainer:.2f}x the profile's), decode "
          f"step {index['decode_step_s'] * 1e3:.2f} ms at batch {index['batch']} ({engine:.2f}x the profile's speed)")
    if args.out:
        Path(args.out).write_text(json.dumps(index) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
