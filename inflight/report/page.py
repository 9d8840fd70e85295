"""`inflight report RUN_DIR [RUN_DIR ...]`: report.html with PNG plots from the runs' metrics.jsonl (without
matplotlib installed: the tables, replies and configs, and a line saying the plots are missing).

With one run the report goes into that run's folder; with several, every plot draws all runs on the same axes
(e.g. pipelined vs sync) and the report goes into the first run's folder unless --out says otherwise.

Drawn for a reader's glance: held-out accuracy as the score on the whole split (with rotating evaluation subsets,
the mean of the last full rotation of windows; each window's own score faint behind it), and every per-step series
as its exponential moving average (debiased, as TensorBoard and W&B smooth) over the raw points drawn faint.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from inflight.actor.eval_subset import binomial_stderr, whole_split_series
from inflight.report.metrics import read_metrics
from inflight.report.replies import replies_html

PLOTS = ("accuracy", "reward", "lengths", "lag_hist", "server_throughput", "pause", "trainer", "lr",
         "dynamic_sampling")
RAW_ALPHA = 0.25  # the raw points behind a smoothed line, and each rotating window's score behind the whole split


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


def _split_of(r: dict) -> tuple[float, int, int]:
    """(accuracy, problems scored, split size) of an eval record (a record without split_size scored the split)."""
    n = int(r.get("num_problems") or 1)
    return float(r["accuracy"]), n, int(r.get("split_size") or n)


def _whole_split_points(run: Run) -> tuple[list[float], list[float], list[float], list[float | None]]:
    """As _eval_points, for the whole-split accuracy known after each evaluation (eval_subset.whole_split_series:
    a full evaluation as it is, a rotating window with the windows before it that complete the rotation); only the
    evaluations after which one is known. Its standard error: the record's own for a full evaluation, else the
    binomial one over the split."""
    ts, samples, _, errs = _eval_points(run)
    scored = [r for r in run.events("eval") if r.get("accuracy") is not None]
    split = whole_split_series([_split_of(r) for r in scored])
    out: tuple[list[float], list[float], list[float], list[float | None]] = ([], [], [], [])
    for r, t, x, e, score in zip(scored, ts, samples, errs, split, strict=True):
        if score is None:
            continue
        acc, n, size = _split_of(r)
        out[0].append(t)
        out[1].append(x)
        out[2].append(100.0 * score)
        out[3].append(e if n >= size else 100.0 * binomial_stderr(min(1.0, max(0.0, score)), size))
    return out


def _windows(run: Run) -> tuple[list[float], list[float], list[float], str]:
    """The evaluations that scored a rotating window rather than the whole split: (wall times, samples trained,
    accuracies in %, what a window is: "50 of 200 problems" when they all had one size)."""
    ts, samples, acc, _ = _eval_points(run)
    sizes = [_split_of(r)[1:] for r in run.events("eval") if r.get("accuracy") is not None]
    keep = [k for k, (n, size) in enumerate(sizes) if n < size]
    kinds = {sizes[k] for k in keep}
    what = f"{next(iter(kinds))[0]} of {next(iter(kinds))[1]} problems" if len(kinds) == 1 else "a slice of the split"
    return [ts[k] for k in keep], [samples[k] for k in keep], [acc[k] for k in keep], what


def smoothing_weight(n: int) -> float:
    """The EMA weight for a series of n points: an effective window of ~n/10 points (a 500-step run averages ~50
    steps, a 100-step one ~10), between 0.6 (TensorBoard's default) and 0.98."""
    return min(0.98, max(0.6, 1.0 - 10.0 / max(n, 1)))


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with debiasing, as TensorBoard and W&B smooth a curve: m_k = w m_(k-1) +
    (1 - w) y_k from m_0 = 0, divided by 1 - w^k so the first points are not pulled towards 0. A non-finite value
    is passed through and left out of the average."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must lie in [0, 1), got {weight}")
    out, last, count = [], 0.0, 0
    for y in values:
        if not math.isfinite(y):
            out.append(y)
            continue
        last = weight * last + (1.0 - weight) * y
        count += 1
        out.append(last / (1.0 - weight ** count))
    return out


def smooth_line(ax: Any, x: list[float], y: list[float], label: str, color: str, **kw: Any) -> None:
    """The raw points faint and thin, their EMA (smoothing_weight) on top in the same color; only the EMA gets the
    legend entry."""
    if not x:
        return
    ax.plot(x, y, color=color, alpha=RAW_ALPHA, lw=0.8, gid="raw", **kw)
    ax.plot(x, ema(y, smoothing_weight(len(y))), color=color, lw=1.8, label=label, **kw)


def off_scale(values: list[float]) -> tuple[float, float] | None:
    """y-limits that leave a few outliers off the plot, or None for matplotlib's own: when the extremes stretch the
    axis to more than 3x the 1-99% range of the raw values (a first step's start-up wait, one step timed on a
    near-empty batch), the side they are on ends a little past that range, the other just past its extreme. The
    percentiles are values of the series (rounded inwards), so that one outlier in a short series is not one."""
    vals = sorted(v for v in values if math.isfinite(v))
    if len(vals) < 20:
        return None
    lo, hi = vals[math.ceil(0.01 * (len(vals) - 1))], vals[math.floor(0.99 * (len(vals) - 1))]
    span = hi - lo
    if span <= 0 or vals[-1] - vals[0] <= 3 * span:
        return None
    pad = 0.15 * span
    bottom, top = max(vals[0], lo - pad), min(vals[-1], hi + pad)
    margin = 0.05 * (top - bottom)
    return bottom - margin, top + margin


def _clip_outliers(ax: Any) -> None:
    """Leave the raw points' outliers (smooth_line's faint lines) off the axis, saying how many in the legend."""
    raw = [float(v) for line in ax.lines if line.get_gid() == "raw" for v in line.get_ydata()]
    limits = off_scale(raw)
    if limits is None:
        return
    bottom, top = limits
    ax.set_ylim(bottom, top)
    low, high = sum(v < bottom for v in raw), sum(v > top for v in raw)
    parts = ([f"{high} above (up to {max(raw):.3g})"] if high else []) + (
        [f"{low} below (down to {min(raw):.3g})"] if low else [])
    ax.plot([], [], ls="", label=f"raw points off scale: {', '.join(parts)}")


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
    split = [100.0 * s for s in whole_split_series([_split_of(r) for r in scored]) if s is not None]
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
        **_refill_summary(steps),
    }


def _refill_summary(steps: list[dict]) -> dict[str, Any]:
    """Dynamic sampling over the run (actor.dynamic_sampling): the share of generated groups dropped, groups
    generated per group trained, and the share of generated tokens spent on dropped groups."""
    ds = [r for r in steps if "groups_dropped" in r]
    if not ds:
        return {}
    dropped, generated = sum(r["groups_dropped"] for r in ds), sum(r["groups_generated"] for r in ds)
    tokens = sum(r["tokens_dropped"] for r in ds)
    trained_tokens = sum(r.get("completion_tokens", 0) for r in ds)
    return {"dropped_pct": 100.0 * dropped / max(1, generated),
            "generated_per_trained": generated / max(1, generated - dropped),
            "tokens_dropped_pct": 100.0 * tokens / max(1, tokens + trained_tokens),
            "capped_groups": sum(r.get("groups_capped", 0) for r in ds)}


def _plot(name: str, runs: list[Run], out: Path) -> Path:
    import matplotlib.pyplot as plt  # lazy: matplotlib's import is slow and only the report needs it

    fig = figure(name, runs)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def figure(name: str, runs: list[Run]) -> Any:
    """One report plot (a matplotlib Figure, two axes) of every run, each run in its own color."""
    import matplotlib  # lazy: matplotlib's import is slow and only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above
    from matplotlib.ticker import MaxNLocator  # lazy: as above

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    lr_top = 0.0
    for i, run in enumerate(runs):
        c = f"C{i}"
        if name == "accuracy":  # the whole split +- its standard error as a band; single windows faint
            t, s, a, e = _whole_split_points(run)
            wt, ws, wa, window = _windows(run)
            rotating = bool(wt)
            what = "whole split (last full rotation of windows)" if rotating else "whole split"
            for ax, x, wx in ((axes[0], t, wt), (axes[1], s, ws)):
                ax.plot(x, a, marker="o", ms=3, color=c, lw=1.8, label=f"{run.name} {what}", zorder=3)
                bx, lo, hi = _band(x, a, e)
                if bx:
                    ax.fill_between(bx, lo, hi, alpha=0.2, color=c, lw=0, label=f"{run.name} ± stderr")
                if rotating:
                    ax.plot(wx, wa, marker="o", ms=3, ls="", color=c, alpha=RAW_ALPHA,
                            label=f"{run.name} one window ({window})", zorder=2)
            axes[0].set(xlabel="wall time (s)", ylabel="held-out accuracy (%)")
            axes[1].set(xlabel="samples trained", ylabel="held-out accuracy (%)")
        elif name == "reward":
            smooth_line(axes[0], *run.series("train_step", "reward_mean"), run.name, c)
            smooth_line(axes[1], *run.series("train_step", "reward_mean", x="samples_total"), run.name, c)
            axes[0].set(xlabel="wall time (s)", ylabel="mean training reward")
            axes[1].set(xlabel="samples trained", ylabel="mean training reward")
        elif name == "lengths":
            x, mean = run.series("train_step", "completion_len_mean", x="step")
            lo, hi = run.series("train_step", "completion_len_min", x="step")[1], run.series(
                "train_step", "completion_len_max", x="step")[1]
            if x and len(lo) == len(hi) == len(x):
                axes[0].fill_between(x, lo, hi, alpha=0.1, color=c, lw=0, label=f"{run.name} min-max")
            smooth_line(axes[0], x, mean, f"{run.name} mean", c)
            axes[0].set(xlabel="trainer step", ylabel="completion length (tokens)")
            xt, tr = run.series("train_step", "truncated_frac", x="step")
            smooth_line(axes[1], xt, [100 * v for v in tr], f"{run.name} cut off by max_new_tokens", c)
            xe, eos = run.series("train_step", "eos_frac", x="step")
            smooth_line(axes[1], xe, [100 * v for v in eos], f"{run.name} ended with EOS", c, ls="--")
            axes[1].set(xlabel="trainer step", ylabel="share of completions (%)", ylim=(-3, 103))
        elif name == "lag_hist":
            lag: Counter[int] = Counter()
            for r in run.events("train_step"):
                lag.update({int(k): v for k, v in (r.get("lag_hist") or {}).items()})
            ks = sorted(lag)
            total = max(1, sum(lag.values()))
            axes[0].bar([k + 0.1 * i for k in ks], [lag[k] / total for k in ks], width=0.3, color=c, label=run.name)
            axes[0].set(xlabel="lag (trainer version - token version)", ylabel="share of trained tokens")
            axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
            axes[1].plot(*run.series("train_step", "lag_max", x="step"), color=c, lw=0.8, drawstyle="steps-mid",
                         label=f"{run.name} max")
            smooth_line(axes[1], *run.series("train_step", "lag_mean", x="step"), f"{run.name} mean", c, ls="--")
            axes[1].set(xlabel="trainer step", ylabel="lag per step")
        elif name == "server_throughput":
            styles = ("-", "--", ":", "-.")
            for k, srv in enumerate(sorted({int(r["server"]) for r in run.events("server_metrics") if "server" in r})):
                pts = [r for r in run.events("server_metrics") if r.get("server") == srv]
                t = [r["time"] - run.t0 for r in pts]
                ls = styles[k % len(styles)]
                smooth_line(axes[0], t, [r.get("tokens_per_s") or 0 for r in pts], f"{run.name} s{srv}", c, ls=ls)
                smooth_line(axes[1], t, [r.get("batch_occupancy") or 0 for r in pts], f"{run.name} s{srv}", c, ls=ls)
            axes[0].set(xlabel="wall time (s)", ylabel="server generated tokens/s")
            axes[1].set(xlabel="wall time (s)", ylabel="running sequences (batch occupancy)")
        elif name == "pause":
            smooth_line(axes[0], *run.series("weight_push", "pause_s", x="step"), run.name, c)
            axes[0].set(xlabel="weight version", ylabel="server pause per update (s)")
            smooth_line(axes[1], *run.series("weight_push", "push_s", x="step"), f"{run.name} push", c)
            smooth_line(axes[1], *run.series("train_step", "push_wait_s", x="step"),
                        f"{run.name} trainer waiting for it", c, ls="--")
            axes[1].set(xlabel="trainer step", ylabel="weight push (s)")
        elif name == "trainer":
            smooth_line(axes[0], *run.series("train_step", "tokens_per_s"), run.name, c)
            axes[0].set(xlabel="wall time (s)", ylabel="trainer tokens/s (training time only)")
            smooth_line(axes[1], *run.series("train_step", "wait_s"), run.name, c)
            axes[1].set(xlabel="wall time (s)", ylabel="trainer time waiting for data per step (s)")
        elif name == "dynamic_sampling":  # actor.dynamic_sampling: what the refill dropped and what it cost
            x, frac = run.series("train_step", "dropped_frac", x="step")
            smooth_line(axes[0], x, [100 * v for v in frac], f"{run.name} groups", c)
            xt, tfrac = run.series("train_step", "tokens_dropped_frac", x="step")
            smooth_line(axes[0], xt, [100 * v for v in tfrac], f"{run.name} tokens", c, ls="--")
            axes[0].set(xlabel="trainer step", ylabel="share generated then dropped (%)", ylim=(-3, 103))
            xg, gen = run.series("train_step", "groups_generated", x="step")
            smooth_line(axes[1], xg, gen, f"{run.name} generated", c)
            xc, capped = run.series("train_step", "groups_capped", x="step")
            if any(capped):
                axes[1].plot(xc, capped, color=c, lw=0.8, ls=":", label=f"{run.name} capped (all equal, kept)")
            axes[1].set(xlabel="trainer step", ylabel="groups per optimizer step")
        elif name == "lr":  # the schedule as the optimizer applied it, and the gradient norm before clipping
            x, lr = run.series("train_step", "lr", x="step")
            axes[0].plot(x, lr, color=c, lw=1.8, label=run.name)
            axes[0].set(xlabel="trainer step", ylabel="learning rate")
            axes[0].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
            lr_top = max([lr_top, *lr])
            smooth_line(axes[1], *run.series("train_step", "grad_norm", x="step"), run.name, c)
            axes[1].set(xlabel="trainer step", ylabel="gradient norm (before clipping)")
    if lr_top > 0:  # from 0: a decay reads against the peak, not against its own last value
        axes[0].set_ylim(0, 1.08 * lr_top)
    for ax in axes:
        ax.grid(alpha=0.3)
        _clip_outliers(ax)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plots_for(runs: list[Run]) -> list[str]:
    """The report's plots: all of PLOTS, the learning rate's only when a run logged it (train_step's `lr`), dynamic
    sampling's only when a run used it (train_step's `groups_dropped`)."""
    steps = [r for run in runs for r in run.events("train_step")]
    logged = {"lr": any(r.get("lr") is not None for r in steps),
              "dynamic_sampling": any("groups_dropped" in r for r in steps)}
    return [p for p in PLOTS if logged.get(p, True)]


TITLES = {
    "accuracy": "Held-out accuracy vs wall time and vs samples",
    "reward": "Training reward vs wall time and vs samples",
    "lengths": "Completion lengths and endings per trainer step",
    "lag_hist": "Policy lag of trained tokens",
    "server_throughput": "Inference servers: tokens/s and batch occupancy",
    "pause": "Time paused per weight update",
    "trainer": "Trainer tokens/s and time waiting for data",
    "lr": "Learning-rate schedule and gradient norm per trainer step",
    "dynamic_sampling": "Dynamic sampling: groups dropped (rewards all equal) and groups generated per step",
}
SMOOTHED = "Lines: exponential moving average (debiased, as TensorBoard and W&B smooth); faint: the raw values."
NOTES = {  # a line under a plot's title; SMOOTHED for the others
    "accuracy": "The line is the accuracy on the whole held-out split: a full evaluation as it is, or the mean of the "
                "last full rotation of evaluation windows (each window scores a slice of the split; their own scores "
                "are the faint points and swing by their sampling noise). The band is ± one standard error.",
    "dynamic_sampling": "Left: the share of the groups generated for each step that were dropped (all rewards equal), "
                        "and of their tokens. Right: groups generated per optimizer step (groups_per_step trained "
                        "+ dropped), and groups kept at the try cap (actor.dynamic_sampling_max_tries). "
                        + SMOOTHED,
    "lr": "Left: the learning rate each optimizer step applied (trainer.schedule). Right: " + SMOOTHED[0].lower()
          + SMOOTHED[1:],
}


def write_report(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> Path:
    runs = [Run(d) for d in run_dirs]
    out = Path(out_dir) if out_dir else runs[0].dir
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    rows = [summary(r) for r in runs]
    cols = list(dict.fromkeys(c for row in rows for c in row))  # a run without dynamic sampling lacks its columns
    # headers may break after an underscore, and a table still wider than the window scrolls in its own box
    table = "<tr>" + "".join(f"<th>{html.escape(c).replace('_', '_<wbr>')}</th>" for c in cols) + "</tr>"
    for row in rows:
        cells = "".join(f"<td>{html.escape(str(round(v, 1) if isinstance(v, float) else v))}</td>"
                        for v in (row.get(c, "") for c in cols))
        table += f"<tr>{cells}</tr>"
    body = [f"<h1>inflight report: {html.escape(', '.join(r.name for r in runs))}</h1>", f"<div class='wide'><table>{table}</table></div>"]
    if importlib.util.find_spec("matplotlib") is None:  # a machine without it still gets the tables
        body.append("<p>No plots: matplotlib is not installed (<code>pip install matplotlib</code>, then "
                    "<code>inflight report RUN_DIR</code>).</p>")
    else:
        for name in plots_for(runs):
            png = _plot(name, runs, plots)
            note = html.escape(NOTES.get(name, SMOOTHED))
            body.append(f"<h2>{TITLES[name]}</h2><p class='note'>{note}</p><img src='plots/{png.name}'>")
    for run in runs:
        body.append(replies_html(run))
    for run in runs:
        cfg = run.dir / "config.yaml"
        if cfg.exists():
            body.append(f"<h2>config: {html.escape(run.name)}</h2><pre>{html.escape(cfg.read_text())}</pre>")
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px}img{max-width:100%}.note{color:#555;font-size:90%}"
             ".wide{overflow-x:auto}td.reply{font-family:monospace;white-space:pre-wrap}.correct{background:#e6f4e6}.cut{background:#fbe9e7}")
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
