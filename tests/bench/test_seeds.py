"""bench/seeds.py: the per-seed curves and their mean / spread on runs written by the real metrics logger (fast),
the report overlaying the seed runs, and a real two-seed run of the script."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.report.metrics import MetricsLogger
from inflight.report.page import write_report

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "seeds.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_seeds", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_seed(run_dir: Path, accs: list[float], skip: int | None = None) -> None:
    """base, in-run evaluations at steps 10, 20, ... (trainer_version one past the point), final."""
    actor, trainer = MetricsLogger(run_dir, "actor"), MetricsLogger(run_dir, "trainer")
    MetricsLogger(run_dir, "launcher").log("run_start")
    actor.log("eval", step=0, accuracy=accs[0], base=True, trainer_version=0, stderr=0.03, num_problems=200)
    for k, a in enumerate(accs[1:-1], 1):
        trainer.log("train_step", step=10 * k, samples_total=1280 * k)
        if k != skip:
            actor.log("eval", step=10 * k + 1, accuracy=a, trainer_version=10 * k + 1, stderr=0.07, num_problems=50)
    actor.log("eval", step=99, accuracy=accs[-1], final=True, trainer_version=99, stderr=0.03, num_problems=200)
    actor.close()
    trainer.close()


def test_curves_mean_and_spread_per_point(tmp_path):
    b = load()
    seeds = {"s0": [0.30, 0.40, 0.50, 0.60], "s1": [0.30, 0.50, 0.45, 0.70], "s2": [0.30, 0.35, 0.55, 0.65]}
    for name, accs in seeds.items():
        write_seed(tmp_path / name, accs, skip=1 if name == "s2" else None)
    curves = {n: b.curve(tmp_path / n, 10) for n in seeds}
    assert list(curves["s0"]) == ["base", "step 10", "step 20", "final"]
    assert "step 10" not in curves["s2"]  # a skipped evaluation is left out, not shifted
    rows = b.table(curves)
    assert [r["point"] for r in rows] == ["base", "step 10", "step 20", "final"]
    for r in rows:
        i = ["base", "step 10", "step 20", "final"].index(r["point"])
        vals = [100 * seeds[n][i] for n in seeds if not (n == "s2" and i == 1)]
        assert r["n"] == len(vals) and r["mean"] == pytest.approx(sum(vals) / len(vals))
        assert r["spread"] == pytest.approx(max(vals) - min(vals))
        assert r["std"] == pytest.approx(statistics.stdev(vals))
    assert rows[1]["stderr"] == pytest.approx(7.0) and rows[0]["stderr"] == pytest.approx(3.0)
    text = b.render(rows, list(seeds))
    assert "| step 10 | 40.0 | 50.0 | - | 45.0 | 10.0 | 7.1 | 7.0 |" in text
    assert "| final | 60.0 | 70.0 | 65.0 | 65.0 | 10.0 | 5.0 | 3.0 |" in text
    # the report overlays the seed runs: one row per run, each curve on the same axes
    path = write_report([tmp_path / n for n in seeds], tmp_path / "cmp")
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert [r["run"] for r in summary] == list(seeds) and path.exists()
    assert [r["last_accuracy"] for r in summary] == pytest.approx([60.0, 70.0, 65.0])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_seeds_run_side_by_side(tiny_model_dir, tmp_path):
    out = tmp_path / "seeds"
    small = ["task.eval_size=8", "actor.group_size=4", "actor.groups_per_step=2", "actor.max_new_tokens=8",
             "actor.eval_every=2", "actor.eval_subset=4", "server.max_batch=32", "pipeline.max_steps=4",
             f"model.path={tiny_model_dir}"]
    args = [sys.executable, str(SCRIPT), str(REPO / "configs" / "cpu-demo.yaml"), "--seeds", "3,4", "--out", str(out)]
    for o in small:
        args += ["--override", o]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "| point | cpu-demo-seed3 | cpu-demo-seed4 | mean |" in res.stdout
    assert "| base |" in res.stdout and "| final |" in res.stdout
    for s in (3, 4):
        cfg = (out / f"cpu-demo-seed{s}" / "config.yaml").read_text()
        assert f"seed: {s}" in cfg
    assert (out / "report.html").exists()
    rows = json.loads((out / "summary.json").read_text())
    assert [r["run"] for r in rows] == ["cpu-demo-seed3", "cpu-demo-seed4"] and all(r["steps"] == 4 for r in rows)
