"""What held-out evaluation cost a run, from the run's own metrics.jsonl, and whether weight pushes waited for it.

    .venv/bin/python bench/eval_cost.py runs/cpu-demo [RUN_DIR ...]

Per run:
- evaluation's share of the servers' work: the tokens the in-run evaluations prefilled and generated over every
  token the servers processed (their own prefill + generated counters, last scrape); for eval records without
  token counts (older runs) the prompt length is the rollouts' mean (train_step prompt_tokens per group);
- evaluation's share of the wall clock: seconds with an in-run evaluation in flight over the RL run's seconds
  (run_start to trainer_done; evaluations overlap the rollouts, so this is an upper bound of their cost);
- the base and final evaluations (the whole held-out split, before any rollout and after the trainer finished);
- weight pushes: median and p95 of push_s (optimizer step done -> every server answered), all of them and those
  that overlapped an in-run evaluation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml


def read(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pct(values: list[float], q: float) -> float:
    """The q-quantile, nearest rank (q = 0.5: the median's upper neighbour for an even count)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def eval_cost(records: list[dict], group_size: int = 8) -> dict:
    ev = lambda name: [r for r in records if r.get("event") == name]  # noqa: E731
    steps, evals, pushes = ev("train_step"), ev("eval"), ev("weight_push")
    in_run = [e for e in evals if not e.get("base") and not e.get("final")]
    groups = sum(s.get("samples", 0) for s in steps) / max(1, group_size)
    prompt_len = sum(s.get("prompt_tokens", 0) for s in steps) / groups if groups else 0.0  # counted once per group

    def tokens(e: dict) -> float:
        if e.get("prompt_tokens") is not None:
            return float(e["prompt_tokens"] + e["completion_tokens"])
        n = e.get("num_problems", 0)
        return n * (prompt_len + float(e.get("completion_len_mean", 0.0)))

    servers: dict = {}
    for r in ev("server_metrics"):
        servers[r.get("server")] = r
    served = sum(float(r.get("generated_tokens_total", 0)) + float(r.get("prefill_tokens_total", 0))
                 for r in servers.values())
    t0 = next((r["time"] for r in records if r.get("event") == "run_start"), records[0]["time"])
    t1 = next((r["time"] for r in ev("trainer_done")), steps[-1]["time"] if steps else t0)
    windows = [(e["time"] - e["seconds"], e["time"]) for e in in_run]
    during = [p for p in pushes if any(a < p["time"] and p["time"] - p["push_s"] < b for a, b in windows)]
    push = [p["push_s"] for p in pushes if p.get("push_s") is not None]
    push_eval = [p["push_s"] for p in during if p.get("push_s") is not None]
    return {
        "evaluations": len(in_run),
        "problems_per_eval": statistics.median(e["num_problems"] for e in in_run) if in_run else 0,
        "eval_token_share": sum(map(tokens, in_run)) / served if served else None,
        "eval_wall_share": sum(e["seconds"] for e in in_run) / max(1e-9, t1 - t0),
        "base_final_s": sum(e["seconds"] for e in evals if e.get("base") or e.get("final")),
        "rl_wall_s": t1 - t0,
        "pushes": len(push),
        "push_p50_s": statistics.median(push) if push else None,
        "push_p95_s": pct(push, 0.95) if push else None,
        "pushes_during_eval": len(push_eval),
        "push_during_eval_p50_s": statistics.median(push_eval) if push_eval else None,
        "push_during_eval_p95_s": pct(push_eval, 0.95) if push_eval else None,
    }


def fmt(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+")
    args = ap.parse_args(argv)
    rows = []
    for d in args.run_dirs:
        try:
            cfg = Path(d) / "config.yaml"
            g = (yaml.safe_load(cfg.read_text()) or {}).get("actor", {}).get("group_size", 8) if cfg.exists() else 8
            rows.append((d, eval_cost(read(Path(d)), g)))
        except FileNotFoundError as exc:
            print(f"eval_cost: {exc}", file=sys.stderr)
            return 2
    keys = list(rows[0][1])
    print("| run | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for d, r in rows:
        print(f"| {d} | " + " | ".join(fmt(r[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
