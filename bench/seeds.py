"""One config over several seeds: each seed's held-out accuracy curve, and the mean and spread at each point.

    .venv/bin/python bench/seeds.py configs/cpu-demo.yaml --seeds 0,1,2              # runs/seeds/cpu-demo-seed{0,1,2}
    .venv/bin/python bench/seeds.py configs/cpu-demo.yaml --seeds 0,1,2 --override pipeline.max_minutes=3
    .venv/bin/python bench/seeds.py configs/cpu-demo.yaml --seeds 0,1,2 --report-only  # read the runs again

Each seed is one `inflight train CONFIG seed=S name=<config name>-seed<S> pipeline.run_dir=OUT` (free ports), run
one after the other, so the folders sit side by side in OUT (default runs/seeds). The seed sets the prompt order,
the sampling and the trainer's randomness; the model is the config's (the tiny demo's comes from `make demo`).
A point of the curve is an evaluation: `base` (the starting weights, whole held-out split), `step K` (the in-run
evaluation at trainer step K, which may score a rotating subset, actor.eval_subset) and `final` (whole split, the
last weights). Steps are grouped by actor.eval_every, so the seeds' evaluations line up even when one was skipped.
For each point: every seed's accuracy (%), then the mean, the spread (max - min) and the standard deviation over
the seeds that have it, and the mean binomial standard error of one evaluation (how much of the spread one
evaluation's own noise explains). Finally `inflight report` overlays all the runs (OUT/report.html).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_seeds(ap: argparse.ArgumentParser, text: str) -> list[int]:
    """--seeds "0,1,2" as integers, or the parser's usage error."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, not {text!r}")
    if not seeds:
        ap.error("--seeds names no seed")
    return seeds


def run_seed(config: Path, name: str, seed: int, out: Path, extra: list[str]) -> Path:
    """One `inflight train` run; returns its folder. A failed run is reported, not fatal."""
    run = f"{name}-seed{seed}"
    cmd = [sys.executable, "-m", "inflight.cli", "train", str(config), f"seed={seed}", f"name={run}",
           f"pipeline.run_dir={out}", f"server.base_port={free_port()}", f"pipeline.weight_sync_port={free_port()}",
           *extra]
    print(f"seeds: {run}: {' '.join(cmd[2:])}", flush=True)
    with open(out / f"{run}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)  # the launcher stops every role on SIGTERM
            proc.wait(timeout=60)
            raise
    if code != 0:
        print(f"seeds: {run} exited with {code}; see {out / (run + '.log')}", flush=True)
    return out / run


def curve(run_dir: Path, eval_every: int) -> dict[str, tuple[float, float | None]]:
    """{point label: (accuracy %, stderr % or None)} of one run's evaluations (the first one per point)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    out: dict[str, tuple[float, float | None]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("event") != "eval" or r.get("accuracy") is None:
            continue
        if r.get("base"):
            label = "base"
        elif r.get("final"):
            label = "final"
        else:
            step = int(r.get("trainer_version", r.get("step", 0)))
            label = f"step {step // eval_every * eval_every if eval_every > 0 else step}"
        se = r.get("stderr")
        out.setdefault(label, (100.0 * float(r["accuracy"]), None if se is None else 100.0 * float(se)))
    return out


def order(label: str) -> tuple[int, int]:
    return (0, 0) if label == "base" else (2, 0) if label == "final" else (1, int(label.split()[1]))


def table(curves: dict[str, dict[str, tuple[float, float | None]]]) -> list[dict]:
    """One row per point: each run's accuracy, and the mean, spread and standard deviation over the runs."""
    labels = sorted({lab for c in curves.values() for lab in c}, key=order)
    rows = []
    for lab in labels:
        accs = {run: c[lab][0] for run, c in curves.items() if lab in c}
        errs = [c[lab][1] for c in curves.values() if lab in c and c[lab][1] is not None]
        vals = list(accs.values())
        rows.append({"point": lab, "runs": accs, "n": len(vals), "mean": statistics.fmean(vals),
                     "spread": max(vals) - min(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                     "stderr": statistics.fmean(errs) if errs else None})
    return rows


def render(rows: list[dict], runs: list[str]) -> str:
    head = "| point | " + " | ".join(runs) + " | mean | spread | std | one eval's stderr |"
    lines = [head, "|---" * (len(runs) + 5) + "|"]
    for r in rows:
        cells = [f"{r['runs'][n]:.1f}" if n in r["runs"] else "-" for n in runs]
        se = "-" if r["stderr"] is None else f"{r['stderr']:.1f}"
        lines.append(f"| {r['point']} | " + " | ".join(cells)
                     + f" | {r['mean']:.1f} | {r['spread']:.1f} | {r['std']:.1f} | {se} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "seeds", help="folder of the runs (default runs/seeds)")
    ap.add_argument("--override", action="append", default=[], help="a dotted config override for every run")
    ap.add_argument("--report-only", action="store_true", help="read the runs in --out again, run nothing")
    args = ap.parse_args(argv)
    seeds = parse_seeds(ap, args.seeds)
    raw = yaml.safe_load(args.config.read_text()) or {}
    name = raw.get("name", args.config.stem)
    eval_every = int((raw.get("actor") or {}).get("eval_every", 10))
    for o in args.override:  # the overrides may change the name or eval_every too
        key, _, value = o.partition("=")
        if key == "name":
            name = value
        elif key == "actor.eval_every":
            eval_every = int(value)
    args.config, args.out = args.config.resolve(), args.out.resolve()  # the runs start in the repository root
    args.out.mkdir(parents=True, exist_ok=True)
    dirs = [args.out / f"{name}-seed{s}" for s in seeds] if args.report_only else \
        [run_seed(args.config, name, s, args.out, args.override) for s in seeds]
    curves = {d.name: curve(d, eval_every) for d in dirs}
    missing = [n for n, c in curves.items() if not c]
    if missing:
        print(f"seeds: no evaluations in {', '.join(missing)}", file=sys.stderr)
    curves = {n: c for n, c in curves.items() if c}
    if not curves:
        return 1
    print(render(table(curves), list(curves)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rep = subprocess.run([sys.executable, "-m", "inflight.cli", "report", *(str(args.out / n) for n in curves),
                          "--out", str(args.out)], cwd=REPO, capture_output=True, text=True, env=env)
    print(rep.stdout.strip() or rep.stderr.strip()[-2000:])
    return 0 if not missing and rep.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
