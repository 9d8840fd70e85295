"""Pipelined vs sync RL on the same machine: alternating runs (A B A B ...) in one invocation, on two workloads.

    .venv/bin/python bench/pipeline.py [--workloads demo,scratch] [--repeats 2] [--minutes 3] [--build]

Each run is one `inflight train` subprocess (servers, trainer and actor as separate processes) with the workload's
config (configs/bench-<workload>.yaml) and only `pipeline.mode` changed between the two modes; the sync loop uses
`pipeline.num_grad_steps` (4 in the configs) and the same groups_per_step, group size, server batch and threads.
For each run the script reads runs' metrics.jsonl and prints:

- time to target: seconds from "servers ready" to the first held-out evaluation at or above a target accuracy
  (targets = the workload's warm-start accuracy, the median of the step-0 evaluations, + each of --gains points,
  unless --target gives one);
- samples/s: samples trained / seconds from "servers ready" to the last optimizer step;
- the time split that limits the speed-up: trainer busy/waiting share, mean running sequences on the server and
  the share of server scrapes with nothing to decode;

and per workload the ratio sync/pipelined of both (median and range over the repeat pairs).

Workloads: `demo` (2-digit addition, answers of 2-4 tokens; generation is a minor share of the time there) and
`scratch` (arith with a step-by-step scratchpad of 27..128 tokens, generation-heavy). `--build` builds and
warm-starts the models the configs point at when they are missing (make-model + sft, a few minutes each).
Accuracy on 200 held-out problems has about +-3 points of noise: read single crossings with that in mind.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("pipelined", "sync")
# (make-model/sft overrides, sft flags) that build each workload's warm-started model (see the configs)
BUILD = {
    "demo": (['task.prompt="{expr}="'], ["--target-acc", "0.3", "--steps", "2000"]),
    "scratch": (["task.scratchpad=true", "task.digits=2", "task.terms=3", "task.operators=[+,-]",
                 'task.prompt="{expr}="'],
                ["--target-acc", "0.25", "--steps", "3000", "--batch-size", "64", "--eval-every", "100",
                 "--max-new-tokens", "160"]),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_path(config: Path) -> Path:
    from inflight.config import RunConfig, load_config

    path = Path(load_config(RunConfig, config, []).model.path)
    return path if path.is_absolute() else REPO / path


def build_model(workload: str, out: Path) -> None:
    """make-model + sft into `out` (the warm-started model) and `out`-base (its random init)."""
    overrides, sft_flags = BUILD[workload]
    base = out.with_name(out.name + "-base")
    py = [sys.executable, "-m", "inflight.cli"]
    if not (base / "config.json").exists():
        subprocess.run([*py, "make-model", "--task", "arith", str(base), *overrides], check=True, cwd=REPO)
    subprocess.run([*py, "sft", "--task", "arith", "--model", str(base), "--out", str(out), "--wrong-frac", "0",
                    "--micro-batch-tokens", "4096", *sft_flags, "trainer.threads=1", *overrides],
                   check=True, cwd=REPO)


def run_once(config: Path, workload: str, mode: str, rep: int, out: Path, minutes: float, max_steps: int,
             extra: list[str]) -> Path:
    """One `inflight train` run; returns its run folder. A run that fails is reported, not fatal."""
    name = f"{workload}-{mode}-{rep}"
    overrides = [f"name={name}", f"pipeline.run_dir={out}", f"pipeline.mode={mode}",
                 f"pipeline.max_minutes={minutes}", f"pipeline.max_steps={max_steps}",
                 f"server.base_port={free_port()}", f"pipeline.weight_sync_port={free_port()}", *extra]
    cmd = [sys.executable, "-m", "inflight.cli", "train", str(config), *overrides]
    print(f"bench: {name}: {' '.join(cmd[2:])}", flush=True)
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    limit = 60.0 * minutes + 300.0 if minutes else 1800.0
    try:
        code = proc.wait(timeout=limit)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        proc.send_signal(signal.SIGTERM)  # the launcher stops every role on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        if isinstance(exc, KeyboardInterrupt):
            raise
        code = -1
    finally:
        log.close()
    if code != 0:
        print(f"bench: {name} exited with {code}; see {out / (name + '.log')}", flush=True)
    return out / name


# ---- reading a run ------------------------------------------------------------------------------------------------


def read_run(run_dir: Path) -> dict:
    """The numbers of one run from its metrics.jsonl (times relative to the moment the servers were ready)."""
    recs = []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
    ev = lambda name: [r for r in recs if r.get("event") == name]  # noqa: E731
    ready = ev("servers_ready") or ev("run_start")
    if not ready:
        return {"run": run_dir.name, "ok": False}
    t0 = ready[0]["time"]
    steps = ev("train_step")
    evals = [(r["time"] - t0, float(r["accuracy"]), r.get("step")) for r in ev("eval") if r.get("accuracy") is not None]
    evals.sort()
    wall = (steps[-1]["time"] - t0) if steps else 0.0
    samples = steps[-1].get("samples_total", 0) if steps else 0
    servers = [r for r in ev("server_metrics") if r.get("running") is not None]
    busy = lambda key: sum(r.get(key) or 0.0 for r in steps) / wall if wall else None  # noqa: E731
    return {
        "run": run_dir.name, "ok": bool(steps), "steps": len(steps), "samples": samples, "wall_s": wall,
        "samples_per_s": samples / wall if wall else None, "evals": evals,
        "first_acc": evals[0][1] if evals else None, "best_acc": max(a for _, a, _ in evals) if evals else None,
        "last_acc": evals[-1][1] if evals else None,
        "trainer_busy": busy("train_s"), "trainer_wait": busy("wait_s"), "trainer_push": busy("push_wait_s"),
        "server_running": statistics.mean(r["running"] for r in servers) if servers else None,
        "server_idle": sum(1 for r in servers if not r["running"]) / len(servers) if servers else None,
        "server_tok_s": statistics.mean(r["tokens_per_s"] for r in servers if r.get("tokens_per_s") is not None)
        if any(r.get("tokens_per_s") is not None for r in servers) else None,
    }


def time_to(run: dict, target: float) -> float | None:
    return next((t for t, acc, _ in run.get("evals", []) if acc >= target), None)


# ---- the table ----------------------------------------------------------------------------------------------------


def _f(v: float | None, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def ratio_text(pairs: list[tuple[float | None, float | None]], lower_bound: float | None = None) -> str:
    """Median and range of sync/pipelined over the repeat pairs; a sync run that never reached the target counts
    as reaching it at `lower_bound` (the ratio is then a lower bound, marked >=)."""
    vals, censored = [], False
    for p, s in pairs:
        if p is None or p <= 0:
            continue
        if s is None:
            if lower_bound is None:
                continue
            s, censored = lower_bound, True
        vals.append(s / p)
    if not vals:
        return "n/a"
    med = statistics.median(vals)
    return f"{'>=' if censored else ''}{med:.2f}x (range {min(vals):.2f}-{max(vals):.2f}, n={len(vals)})"


def table(workload: str, runs: dict[str, list[dict]], targets: list[float]) -> str:
    head = ("| run | steps | samples/s | warm acc | best acc | "
            + " | ".join(f"s to {100 * t:.1f}%" for t in targets)
            + " | trainer busy / wait | server running seqs | server idle | server tok/s |")
    lines = [f"### {workload}", "", head, "|---" * (head.count("|") - 1) + "|"]
    for mode in MODES:
        for r in runs[mode]:
            times = " | ".join(_f(time_to(r, t), "{:.0f}", "not reached") for t in targets)
            lines.append(
                f"| {r['run']} | {r.get('steps', 0)} | {_f(r.get('samples_per_s'))} | "
                f"{_f(r.get('first_acc'), '{:.1%}')} | {_f(r.get('best_acc'), '{:.1%}')} | {times} | "
                f"{_f(r.get('trainer_busy'), '{:.0%}')} / {_f(r.get('trainer_wait'), '{:.0%}')} | "
                f"{_f(r.get('server_running'))} | {_f(r.get('server_idle'), '{:.0%}')} | "
                f"{_f(r.get('server_tok_s'), '{:.0f}')} |")
    pairs = list(zip(runs["pipelined"], runs["sync"]))
    longest = max((r.get("wall_s") or 0.0 for r in runs["sync"]), default=None)
    lines.append("")
    for t in targets:
        ratio = ratio_text([(time_to(p, t), time_to(s, t)) for p, s in pairs], lower_bound=longest)
        lines.append(f"- time to {100 * t:.1f}% held-out accuracy, sync / pipelined: {ratio}")
    lines.append(f"- samples/s, pipelined / sync: "
                 f"{ratio_text([(s.get('samples_per_s'), p.get('samples_per_s')) for p, s in pairs])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="demo,scratch", help="comma-separated: demo, scratch")
    ap.add_argument("--repeats", type=int, default=2, help="pipelined/sync pairs per workload (A B A B ...)")
    ap.add_argument("--minutes", type=float, default=3.0, help="wall-time limit of each run (pipeline.max_minutes)")
    ap.add_argument("--max-steps", type=int, default=0, help="optimizer-step limit of each run (0 = none)")
    ap.add_argument("--gains", default="10,20", help="targets = warm-start accuracy + these many points (comma list)")
    ap.add_argument("--target", type=float, default=None, help="one absolute target accuracy (0..1) instead")
    ap.add_argument("--report-only", action="store_true", help="only read the runs already in --out and print")
    ap.add_argument("--config-dir", default=str(REPO / "configs"), help="where bench-<workload>.yaml are")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-pipeline"), help="folder for the runs and results")
    ap.add_argument("--build", action="store_true", help="build and warm-start missing models first")
    ap.add_argument("--override", action="append", default=[], help="extra key=value for every run (repeatable)")
    args = ap.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    configs = {w: Path(args.config_dir) / f"bench-{w}.yaml" for w in workloads}
    for w, cfg in configs.items():
        if not cfg.exists():
            ap.error(f"no config for workload '{w}': {cfg}")
        model = model_path(cfg)
        model_override = next((o.split("=", 1)[1] for o in args.override if o.startswith("model.path=")), None)
        if model_override is None and not (model / "config.json").exists() and not args.report_only:
            if not args.build:
                ap.error(f"model {model} for '{w}' is missing: run with --build (or pass --override model.path=DIR)")
            build_model(w, model)

    results = {}
    for w in workloads:
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for rep in range(args.repeats):
            for mode in MODES:  # alternate, so slow drifts of the shared machine's load hit both modes alike
                run_dir = out / f"{w}-{mode}-{rep}"
                if not args.report_only:
                    run_once(configs[w], w, mode, rep, out, args.minutes, args.max_steps, args.override)
                runs[mode].append(read_run(run_dir))
        warm = [r["first_acc"] for m in MODES for r in runs[m] if r.get("first_acc") is not None]
        if args.target is not None:
            targets = [args.target]
        else:
            base = statistics.median(warm) if warm else 1.0
            targets = [round(base + float(g) / 100.0, 4) for g in args.gains.split(",")]
        text = table(w, runs, targets)
        print("\n" + text + "\n", flush=True)
        results[w] = {"targets": targets, "table": text, "runs": runs}
    cmd = "bench/pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    name = "results" + ("-" + "-".join(workloads) if workloads != ["demo", "scratch"] else "")
    name += "-report" if args.report_only else ""  # a re-read never overwrites the measured run's results
    (out / f"{name}.json").write_text(json.dumps({"command": cmd, **results}, indent=1, default=str))
    (out / f"{name}.md").write_text(f"`{cmd}`\n\n" + "\n\n".join(r["table"] for r in results.values()) + "\n")
    print(f"bench: results in {out / (name + '.md')} and {name}.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
