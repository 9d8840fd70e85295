"""`inflight report RUN_DIR [RUN_DIR ...]`: report.html with PNG plots from the runs' metrics.jsonl (without
matplotlib installed: the tables, replies and configs, and a line saying the plots are missing).

With one run the report goes into that run's folder; with several, every plot draws all runs on the same axes
(e.g. pipelined vs sync) and the report goes into the first run's folder unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any

from inflight.actor.eval_subset import binomial_stderr, whole_split_scores
from inflight.pipeline.metrics import read_metrics
from inflight.pipeline.replies import replies_html

PLOTS = ("accuracy", "reward", "lengths", "lag_hist", "server_throughput", "pause", "trainer")


class Run:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.name = self.dir.name
        self.records = read_metrics(self.dir)
        if not self.records:
            raise FileNotFoundError(f"{self.dir / 'metrics.jsonl'} is missing or empty")
        starts = [r["time"] for r in self.records if r.get("event") == "run_start"]
        self.t0 = starts[0] if starts else min(r["time"] for r in self.records)

    def events(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("event") == name]

    def series(self, event: str, key: str, x: str = "time") -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for r in self.events(event):
            if r.get(key) is None:
                continue
            xv = (r["time"] - self.t0) if x == "time" else r.get(x)
            if xv is None:
                continue
            xs.append(float(xv))
            ys.append(float(r[key]))
        return xs, ys


def _samples_at(run: Run) -> list[tuple[float, float]]:
    """(wall time, samples trained) after every trainer step, to place evaluations on the samples axis."""
    return [(r["time"], r.get("samples_total", 0)) for r in run.events("train_step")]


def _eval_points(run: Run) -> tuple[list[float], list[float], list[float], list[float | None]]:
    """(wall times, samples trained, accuracies in %, their standard errors in %) of the run's evaluations; a
    record without `stderr` (older runs) gets the binomial one from its accuracy and num_problems, if it has them."""
    steps = _samples_at(run)
    ts, samples, acc, err = [], [], [], []
    for r in run.events("eval"):
        if r.get("accuracy") is None:
            continue
        before = [s for t, s in steps if t <= r["time"]]
        ts.append(r["time"] - run.t0)
        samples.append(float(r.get("samples_total", before[-1] if before else 0)))
        acc.append(100.0 * float(r["accuracy"]))
        se = r.get("stderr")
        if se is None and r.get("num_problems"):
            se = binomial_stderr(float(r["accuracy"]), int(r["num_problems"]))
        err.append(None if se is None else 100.0 * float(se))
    return ts, samples, acc, err


def _band(xs: list[float], ys: list[float], errs: list[float | None]) -> tuple[list[float], list[float], list[float]]:
    """The points that have a standard error: (x, y - stderr, y + stderr)."""
    pts = [(x, y - e, y + e) for x, y, e in zip(xs, ys, errs, strict=True) if e is not None]
    return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]


def late_mean(steps: list[dict], key: str, share: float = 0.1) -> float | None:
    """Mean of `key` over the last `share` of the steps that logged it (at least one step)."""
    vals = [float(r[key]) for r in steps if r.get(key) is not None]
    if not vals:
        return None
    tail = vals[-max(1, round(share * len(vals))):]
    return sum(tail) / len(tail)


def summary(run: Run) -> dict[str, Any]:
    steps = run.events("train_step")
    _, _, evals, errs = _eval_points(run)
    lag: Counter[int] = Counter()
    for r in steps:
        lag.update({int(k): v for k, v in (r.get("lag_hist") or {}).items()})
    done = run.events("trainer_done")
    scored = [r for r in run.events("eval") if r.get("accuracy") is not None]
    split = [100.0 * s for s in whole_split_scores(
        [(float(r["accuracy"]), int(r.get("num_problems") or 1), int(r.get("split_size") or r.get("num_problems") or 1))
         for r in scored])]
    return {
        "run": run.name,
        "steps": len(steps),
        "samples": steps[-1].get("samples_total", 0) if steps else 0,
        "wall_s": round((done[-1]["time"] if done else run.records[-1]["time"]) - run.t0, 1),
        "base_accuracy": next((100.0 * float(r["accuracy"]) for r in run.events("eval")
                               if r.get("base") and r.get("accuracy") is not None), None),
        "first_accuracy": evals[0] if evals else None,
        "last_accuracy": evals[-1] if evals else None,
        "last_stderr": errs[-1] if errs else None,
        "best_accuracy": max(split, default=None),  # a single rotating subset's best would be its luckiest draw
        "lag_max": max(lag) if lag else None,
        "mixed_version_samples": sum(r.get("mixed_version_samples", 0) for r in steps),
        # the last 10% of the steps: a policy that learnt not to stop shows here first
        "completion_len_last": late_mean(steps, "completion_len_mean"),
        "truncated_pct_last": None if (t := late_mean(steps, "truncated_frac")) is None else 100.0 * t,
        "warnings": len(run.events("warning")),
    }


def _plot(name: str, runs: list[Run], out: Path) -> Path:
    import matplotlib.pyplot as plt  # lazy: matplotlib's import is slow and only the report needs it

    fig = figure(name, runs)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def figure(name: str, runs: list[Run]) -> Any:
    """One report plot (a matplotlib Figure, two axes) of every run."""
    import matplotlib  # lazy: matplotlib's import is slow and only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for run in runs:
        if name == "accuracy":  # each evaluation +- its standard error as a band
            t, s, a, e = _eval_points(run)
            for ax, x in ((axes[0], t), (axes[1], s)):
                line = ax.plot(x, a, marker="o", label=run.name)[0]
                bx, lo, hi = _band(x, a, e)
                if bx:
                    ax.fill_between(bx, lo, hi, alpha=0.2, color=line.get_color(), label=f"{run.name} ± stderr")
            axes[0].set(xlabel="wall time (s)", ylabel="held-out accuracy (%)")
            axes[1].set(xlabel="samples trained", ylabel="held-out accuracy (%)")
        elif name == "reward":
            axes[0].plot(*run.series("train_step", "reward_mean"), label=run.name)
            axes[1].plot(*run.series("train_step", "reward_mean", x="samples_total"), label=run.name)
            axes[0].set(xlabel="wall time (s)", ylabel="mean training reward")
            axes[1].set(xlabel="samples trained", ylabel="mean training reward")
        elif name == "lengths":
            x, mean = run.series("train_step", "completion_len_mean", x="step")
            line = axes[0].plot(x, mean, label=f"{run.name} mean")[0]
            lo, hi = run.series("train_step", "completion_len_min", x="step")[1], run.series(
                "train_step", "completion_len_max", x="step")[1]
            if len(lo) == len(hi) == len(x):
                axes[0].fill_between(x, lo, hi, alpha=0.15, color=line.get_color(), label=f"{run.name} min-max")
            axes[0].set(xlabel="trainer step", ylabel="completion length (tokens)")
            xt, tr = run.series("train_step", "truncated_frac", x="step")
            axes[1].plot(xt, [100 * v for v in tr], label=f"{run.name} cut off by max_new_tokens")
            xe, eos = run.series("train_step", "eos_frac", x="step")
            axes[1].plot(xe, [100 * v for v in eos], ls="--", label=f"{run.name} ended with EOS")
            axes[1].set(xlabel="trainer step", ylabel="share of completions (%)", ylim=(-3, 103))
        elif name == "lag_hist":
            lag: Counter[int] = Counter()
            for r in run.events("train_step"):
                lag.update({int(k): v for k, v in (r.get("lag_hist") or {}).items()})
            ks = sorted(lag)
            total = max(1, sum(lag.values()))
            axes[0].bar([k + 0.1 * runs.index(run) for k in ks], [lag[k] / total for k in ks], width=0.3,
                        label=run.name)
            axes[0].set(xlabel="lag (trainer version - token version)", ylabel="share of trained tokens")
            axes[1].plot(*run.series("train_step", "lag_max", x="step"), label=f"{run.name} max")
            axes[1].plot(*run.series("train_step", "lag_mean", x="step"), ls="--", label=f"{run.name} mean")
            axes[1].set(xlabel="trainer step", ylabel="lag per step")
        elif name == "server_throughput":
            for srv in sorted({int(r["server"]) for r in run.events("server_metrics") if "server" in r}):
                pts = [r for r in run.events("server_metrics") if r.get("server") == srv]
                t = [r["time"] - run.t0 for r in pts]
                axes[0].plot(t, [r.get("tokens_per_s") or 0 for r in pts], label=f"{run.name} s{srv}")
                axes[1].plot(t, [r.get("batch_occupancy") or 0 for r in pts], label=f"{run.name} s{srv}")
            axes[0].set(xlabel="wall time (s)", ylabel="server generated tokens/s")
            axes[1].set(xlabel="wall time (s)", ylabel="running sequences (batch occupancy)")
        elif name == "pause":
            axes[0].plot(*run.series("weight_push", "pause_s", x="step"), marker=".", label=run.name)
            axes[0].set(xlabel="weight version", ylabel="server pause per update (s)")
            axes[1].plot(*run.series("weight_push", "push_s", x="step"), marker=".", label=f"{run.name} push")
            axes[1].plot(*run.series("train_step", "push_wait_s", x="step"), marker=".", ls="",
                         label=f"{run.name} trainer waiting for it")
            axes[1].set(xlabel="trainer step", ylabel="weight push (s)")
        elif name == "trainer":
            axes[0].plot(*run.series("train_step", "tokens_per_s"), label=run.name)
            axes[0].set(xlabel="wall time (s)", ylabel="trainer tokens/s (training time only)")
            axes[1].plot(*run.series("train_step", "wait_s"), label=run.name)
            axes[1].set(xlabel="wall time (s)", ylabel="trainer time waiting for data per step (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


TITLES = {
    "accuracy": "Held-out accuracy vs wall time and vs samples",
    "reward": "Training reward vs wall time and vs samples",
    "lengths": "Completion lengths and endings per trainer step",
    "lag_hist": "Policy lag of trained tokens",
    "server_throughput": "Inference servers: tokens/s and batch occupancy",
    "pause": "Time paused per weight update",
    "trainer": "Trainer tokens/s and time waiting for data",
}


def write_report(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> Path:
    runs = [Run(d) for d in run_dirs]
    out = Path(out_dir) if out_dir else runs[0].dir
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    rows = [summary(r) for r in runs]
    cols = list(rows[0])
    table = "<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>"
    for row in rows:
        cells = "".join(f"<td>{html.escape(str(round(v, 1) if isinstance(v, float) else v))}</td>"
                        for v in row.values())
        table += f"<tr>{cells}</tr>"
    body = [f"<h1>inflight report: {html.escape(', '.join(r.name for r in runs))}</h1>", f"<table>{table}</table>"]
    if importlib.util.find_spec("matplotlib") is None:  # a machine without it still gets the tables
        body.append("<p>No plots: matplotlib is not installed (<code>pip install matplotlib</code>, then "
                    "<code>inflight report RUN_DIR</code>).</p>")
    else:
        for name in PLOTS:
            png = _plot(name, runs, plots)
            body.append(f"<h2>{TITLES[name]}</h2><img src='plots/{png.name}'>")
    for run in runs:
        body.append(replies_html(run))
    for run in runs:
        cfg = run.dir / "config.yaml"
        if cfg.exists():
            body.append(f"<h2>config: {html.escape(run.name)}</h2><pre>{html.escape(cfg.read_text())}</pre>")
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px}img{max-width:100%}"
             "td.reply{font-family:monospace;white-space:pre-wrap}.correct{background:#e6f4e6}.cut{background:#fbe9e7}")
    path = out / "report.html"
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>inflight report</title>"
                    f"<style>{style}</style></head><body>{''.join(body)}</body></html>")
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", help="runs/<name> folders (several: drawn on the same axes)")
    parser.add_argument("--out", default=None, help="folder for report.html (default: the first run's folder)")


def run(args: argparse.Namespace) -> int:
    try:
        path = write_report(args.run_dirs, args.out)
    except FileNotFoundError as exc:
        print(f"inflight report: {exc}")
        return 2
    print(f"report: {path}")
    return 0
