"""The completion-length curve of runs, as a table: per tenth of each run's trainer steps, the mean completion length
and the share of completions cut off by max_new_tokens; then the held-out accuracy (first, best, last).

    .venv/bin/python bench/lengths.py runs/cpu-demo [runs/other ...]

Runs from before the per-step length metrics existed (no `completion_len_mean`) show the trained tokens per sample
(the same number: every completion token trains) and no cut-off share.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight.report.metrics import read_metrics  # noqa: E402

PARTS = 10


def length(r: dict) -> float:
    return r["completion_len_mean"] if "completion_len_mean" in r else r["tokens"] / max(1, r["samples"])


def rows(run_dir: Path) -> list[str]:
    steps = read_metrics(run_dir, "train_step")
    evals = [100 * r["accuracy"] for r in read_metrics(run_dir, "eval") if r.get("accuracy") is not None]
    if not steps:
        raise SystemExit(f"{run_dir}: no train_step records")
    cells_len, cells_cut = [], []
    for k in range(PARTS):
        part = steps[k * len(steps) // PARTS : (k + 1) * len(steps) // PARTS] or steps[-1:]
        cells_len.append(f"{sum(length(r) for r in part) / len(part):.2f}")
        cut = [r["truncated_frac"] for r in part if "truncated_frac" in r]
        cells_cut.append(f"{100 * sum(cut) / len(cut):.1f}" if cut else "-")
    acc = f"{evals[0]:.1f} / {max(evals):.1f} / {evals[-1]:.1f}" if evals else "-"
    head = f"| {run_dir.name} | {len(steps)} | {acc} |"
    return [f"{head} mean length | " + " | ".join(cells_len) + " |",
            f"{head} cut off (%) | " + " | ".join(cells_cut) + " |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", type=Path)
    args = ap.parse_args()
    tenths = [f"{10 * k}-{10 * (k + 1)}%" for k in range(PARTS)]
    print("| run | steps | held-out acc first / best / last | per tenth of the steps | " + " | ".join(tenths) + " |")
    print("|" + "---|" * (4 + PARTS))
    for d in args.run_dirs:
        print("\n".join(rows(d)))


if __name__ == "__main__":
    main()
