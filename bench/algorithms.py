"""Every algorithm on one config and the same seeds: held-out accuracy at equal samples and at equal time,
samples/s and tokens per completion, one row per algorithm.

    .venv/bin/python bench/algorithms.py configs/cpu-demo.yaml --seeds 0,1,2 --override pipeline.max_minutes=6
    .venv/bin/python bench/algorithms.py configs/cpu-demo.yaml --algos grpo,gspo,cispo --seeds 0
    .venv/bin/python bench/algorithms.py configs/cpu-demo.yaml --report-only       # read the runs in --out again

Each (algorithm, seed) is one `inflight train CONFIG <the algorithm's settings> seed=S` run (bench/seeds.py), one
after the other, in OUT (default runs/algorithms) as `<algorithm>-seed<S>`. Give every run the same
`pipeline.max_minutes` so the final evaluation compares them at equal time. Columns:
    final %       the final evaluation (whole held-out split, last weights): equal time when max_minutes binds
    at step K %   the in-run evaluation at the last evaluation step every run reached: equal samples, since every
                  step trains actor.groups_per_step groups of actor.group_size samples whatever the algorithm
    samples/s     trained samples over the trainer's elapsed time at its last step
    tokens/compl  mean completion length over the run's steps
Accuracies are the mean over the seeds with their spread (max - min): a difference smaller than the spread is noise.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

# name -> the settings that select it (on top of the config's own); the first is the baseline
ALGORITHMS: dict[str, list[str]] = {
    "grpo": [],
    "dr_grpo": ["algo.normalization=constant"],
    "gspo": ["algo.loss=gspo"],
    "cispo": ["algo.loss=cispo"],
    "ppo": ["algo.loss=ppo"],
    "decoupled_ppo": ["algo.loss=decoupled_ppo"],
    "aipo": ["algo.loss=aipo"],
    "reinforce_pp_baseline": ["algo.advantage=reinforce_pp_baseline"],
    "ppo_critic": ["algo.loss=ppo", "algo.advantage=gae"],
    "grpo_masked_is": ["algo.is_mask=geometric"],
    "grpo_dynamic_sampling": ["actor.dynamic_sampling=true"],
}


@functools.cache
def _seeds_module():  # bench/seeds.py, loaded once (bench/ is not a package)
    spec = importlib.util.spec_from_file_location("bench_seeds", REPO / "bench" / "seeds.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_figures(run_dir: Path, eval_every: int) -> dict:
    """One run's evaluations ({point: accuracy %}), samples/s and tokens per completion (None when absent)."""
    curve = {k: acc for k, (acc, _) in _seeds_module().curve(run_dir, eval_every).items()}
    steps = []
    path = run_dir / "metrics.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        r = json.loads(line) if line.strip() else {}
        if r.get("event") == "train_step":
            steps.append(r)
    last = steps[-1] if steps else {}
    elapsed = last.get("elapsed_s") or 0.0
    lengths = [r["completion_len_mean"] for r in steps if r.get("completion_len_mean") is not None]
    return {"curve": curve,
            "samples_per_s": last["samples_total"] / elapsed if elapsed > 0 and "samples_total" in last else None,
            "tokens_per_completion": statistics.fmean(lengths) if lengths else None}


def common_step(figures: dict[str, list[dict]]) -> str | None:
    """The last in-run evaluation point ("step K") that every run of every algorithm has."""
    points = [set(k for k in f["curve"] if k.startswith("step ")) for runs in figures.values() for f in runs]
    shared = set.intersection(*points) if points else set()
    return max(shared, key=lambda k: int(k.split()[1])) if shared else None


def _mean_spread(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{statistics.fmean(vals):.1f} ± {(max(vals) - min(vals)) / 2:.1f}" if len(vals) > 1 else f"{vals[0]:.1f}"


def table(figures: dict[str, list[dict]]) -> list[dict]:
    """One row per algorithm: mean and spread over its seeds of each column."""
    at = common_step(figures)
    rows = []
    for name, runs in figures.items():
        def column(key: str, runs=runs) -> list[float]:
            return [f[key] for f in runs if f[key] is not None]
        rows.append({"algorithm": name, "seeds": len(runs),
                     "final": [f["curve"]["final"] for f in runs if "final" in f["curve"]],
                     "at_step": [f["curve"][at] for f in runs if at and at in f["curve"]], "step": at,
                     "samples_per_s": column("samples_per_s"), "tokens_per_completion": column("tokens_per_completion")})
    return rows


def render(rows: list[dict]) -> str:
    at = rows[0]["step"] if rows else None
    lines = [f"| algorithm | seeds | final % | at {at or 'step -'} % | samples/s | tokens/compl |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        sps = f"{statistics.fmean(r['samples_per_s']):.1f}" if r["samples_per_s"] else "-"
        tpc = f"{statistics.fmean(r['tokens_per_completion']):.1f}" if r["tokens_per_completion"] else "-"
        lines.append(f"| {r['algorithm']} | {r['seeds']} | {_mean_spread(r['final'])} | {_mean_spread(r['at_step'])} "
                     f"| {sps} | {tpc} |")
    return "\n".join(lines) + "\n(mean ± half the spread over the seeds)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--algos", default=",".join(ALGORITHMS), help=f"comma-separated, of {', '.join(ALGORITHMS)}")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "algorithms", help="default runs/algorithms")
    ap.add_argument("--override", action="append", default=[], help="a dotted config override for every run")
    ap.add_argument("--report-only", action="store_true", help="read the runs in --out again, run nothing")
    args = ap.parse_args(argv)
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    unknown = [a for a in algos if a not in ALGORITHMS]
    if unknown or not algos:
        ap.error(f"--algos: unknown {unknown}; choose from {', '.join(ALGORITHMS)}")
    seeds_mod = _seeds_module()
    seeds = seeds_mod.parse_seeds(ap, args.seeds)
    raw = yaml.safe_load(args.config.read_text()) or {}
    eval_every = int((raw.get("actor") or {}).get("eval_every", 10))
    for o in args.override:
        key, _, value = o.partition("=")
        if key == "actor.eval_every":
            eval_every = int(value)
    args.config, args.out = args.config.resolve(), args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, list[dict]] = {}
    for name in algos:
        dirs = [args.out / f"{name}-seed{s}" for s in seeds] if args.report_only else \
            [seeds_mod.run_seed(args.config, name, s, args.out, [*args.override, *ALGORITHMS[name]]) for s in seeds]
        figures[name] = [run_figures(d, eval_every) for d in dirs if (d / "metrics.jsonl").exists()]
    missing = [n for n, runs in figures.items() if len(runs) < len(seeds)]
    if missing:
        print(f"algorithms: runs missing for {', '.join(missing)}", file=sys.stderr)
    print(render(table({n: runs for n, runs in figures.items() if runs})))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
