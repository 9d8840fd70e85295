"""What a finished run's metrics.jsonl tells the simulator: its workload (completion lengths, prompt tokens per
group, the share of samples back-propagated) and what it measured (samples/s, the lag histogram, the trainer's busy
share), for `inflight plan --lengths-from RUN_DIR` and bench/plan_check.py."""

from __future__ import annotations

import json
from pathlib import Path


def read_run(run_dir: str | Path, skip: int = 0) -> dict:
    """samples/s and busy share between the end of step `skip` and the last step (skip >= 1 leaves the start-up
    out; 0 counts from the first step's end), lag histogram and workload over all steps."""
    path = Path(run_dir) / "metrics.jsonl"
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:  # a line cut by a crash
            continue
    steps = [r for r in recs if r.get("event") == "train_step"]
    if len(steps) <= max(1, skip):
        raise ValueError(f"{path}: {len(steps)} optimizer steps, need more than {max(1, skip)}")
    a, b = steps[max(1, skip) - 1], steps[-1]
    lag: dict[int, int] = {}
    for r in steps:
        for k, v in r["lag_hist"].items():
            lag[int(k)] = lag.get(int(k), 0) + v
    lengths = []  # each step's lengths spread from its min to its max with its mean (the records keep no more)
    for r in steps:
        lengths += spread(r["samples"], r["completion_len_mean"], r["completion_len_min"], r["completion_len_max"])
    gps = len(steps[0]["group_indices"]) or 1
    span = b["time"] - a["time"]
    return {
        "steps": len(steps), "samples_per_s": (b["samples_total"] - a["samples_total"]) / span,
        "lag": lag, "lengths": lengths, "prompt_tokens": sum(r["prompt_tokens"] for r in steps) / len(steps) / gps,
        "trained_frac": trained_share(steps, gps),
        "trainer_busy": sum(r["train_s"] for r in steps[max(1, skip):]) / span,
        "step_s": span / (len(steps) - max(1, skip)),
    }


def trained_share(steps: list[dict], groups_per_step: int) -> float:
    """The share of the forward tokens (each group's prompt once, every completion: what the simulator charges the
    trainer for) that the trainer back-propagated. By tokens, not samples: the groups skipped for zero advantage
    (all right or all wrong) are not of average length (on the scratchpad the all-wrong ones ramble: by samples the
    share came out 1.15x too high). A step records the tokens its forward ran over (`trainer_tokens`, each group's
    prompt once per micro-batch) and its prompt tokens with each group's prompt once (`prompt_tokens`)."""
    done = total = 0.0
    for r in steps:
        if "trainer_tokens" not in r:  # an older run's record: by samples
            done += r["trained_samples"] / max(1, r["samples"])
            total += 1
            continue
        done += r["trainer_tokens"]
        total += r["completion_tokens"] + r["prompt_tokens"]
    return min(1.0, done / total) if total else 1.0


def spread(n: int, mean: float, lo: int, hi: int) -> list[int]:
    """n lengths from lo to hi with the given mean: lo + (hi - lo) * u ** k on an even grid u in [0, 1], k set by
    bisection so that the mean matches. A step's batch drains over its whole spread, not at one straggler: with
    the step's min and max alone and the rest at the mean, a simulated on-policy step came out too short."""
    if n < 2 or hi <= lo or not lo < mean < hi:
        return [max(1, round(mean))] * n if n != 2 else [lo, hi]
    target = (mean - lo) / (hi - lo)
    grid = [i / (n - 1) for i in range(n)]

    def m(k: float) -> float:
        return sum(u ** k for u in grid) / n

    a, b = 1e-3, 1e3  # m falls as k grows
    for _ in range(60):
        k = (a * b) ** 0.5
        a, b = (k, b) if m(k) > target else (a, k)
    k = (a * b) ** 0.5
    return [max(1, round(lo + (hi - lo) * u ** k)) for u in grid]
