"""bench/pipeline.py: the metric arithmetic on a hand-written metrics.jsonl (fast), and a real two-run smoke
(pipelined then sync, tiny random model, a few steps) that prints the table (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "pipeline.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_run(path: Path, t0: float, evals: list[tuple[float, float]], steps: list[tuple[float, int, float, float]],
              running: list[int]) -> Path:
    path.mkdir(parents=True)
    recs = [{"time": t0 - 5, "event": "run_start"}, {"time": t0, "event": "servers_ready"}]
    recs += [{"time": t0 + t, "event": "eval", "accuracy": a, "step": i} for i, (t, a) in enumerate(evals)]
    recs += [{"time": t0 + t, "event": "train_step", "samples_total": n, "train_s": tr, "wait_s": w}
             for t, n, tr, w in steps]
    recs += [{"time": t0 + i, "event": "server_metrics", "running": r, "tokens_per_s": 100.0 * r}
             for i, r in enumerate(running)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + "{cut line")
    return path


def test_read_run_and_ratios(tmp_path):
    b = load_bench()
    p = b.read_run(write_run(tmp_path / "p", 1000.0, [(1.0, 0.30), (10.0, 0.38), (20.0, 0.45), (30.0, 0.41)],
                             [(10.0, 128, 4.0, 1.0), (40.0, 512, 6.0, 2.0)], [0, 64, 128, 128]))
    s = b.read_run(write_run(tmp_path / "s", 50.0, [(1.0, 0.32), (50.0, 0.36), (80.0, 0.40)],
                             [(80.0, 256, 30.0, 40.0)], [128, 0, 0, 0]))
    assert p["ok"] and p["steps"] == 2 and p["samples"] == 512
    assert p["samples_per_s"] == pytest.approx(512 / 40.0)
    assert p["trainer_busy"] == pytest.approx(10.0 / 40.0) and p["trainer_wait"] == pytest.approx(3.0 / 40.0)
    assert p["first_acc"] == 0.30 and p["best_acc"] == 0.45 and p["last_acc"] == 0.41
    assert p["server_running"] == pytest.approx(80.0) and p["server_idle"] == pytest.approx(0.25)
    assert s["server_idle"] == pytest.approx(0.75)
    # first evaluation at or above the target, in seconds after the servers were ready
    assert b.time_to(p, 0.40) == pytest.approx(20.0) and b.time_to(s, 0.40) == pytest.approx(80.0)
    assert b.time_to(s, 0.50) is None
    # sync/pipelined time ratio: 80/20 and 60/30 -> median 3.0; a sync run that never got there is a lower bound
    assert b.ratio_text([(20.0, 80.0), (30.0, 60.0)]).startswith("3.00x (range 2.00-4.00, n=2)")
    assert b.ratio_text([(20.0, None)], lower_bound=90.0).startswith(">=4.50x")
    assert b.ratio_text([(None, 10.0)]) == "n/a"
    text = b.table("w", {"pipelined": [p], "sync": [s]}, [0.40, 0.45])
    assert "| p | 2 | 12.8 | 30.0% | 45.0% | 20 | 20 |" in text
    assert "| s | 1 | 3.2 | 32.0% | 40.0% | 80 | not reached |" in text
    assert "time to 40.0% held-out accuracy, sync / pipelined: 4.00x" in text
    assert "time to 45.0% held-out accuracy, sync / pipelined: >=4.00x" in text  # 80 s (sync's wall) / 20 s
    assert "samples/s, pipelined / sync: 4.00x" in text


def test_read_run_without_metrics(tmp_path):
    b = load_bench()
    (tmp_path / "r").mkdir()
    assert b.read_run(tmp_path / "r") == {"run": "r", "ok": False}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_runs_both_modes_and_prints_table(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    small = ["task.eval_size=8", "actor.group_size=4", "actor.groups_per_step=2", "actor.max_new_tokens=8",
             "actor.eval_every=2", "server.max_batch=32", "pipeline.num_grad_steps=2", f"model.path={tiny_model_dir}"]
    args = [sys.executable, str(SCRIPT), "--workloads", "demo", "--repeats", "1", "--max-steps", "2",
            "--minutes", "2", "--target", "0.0", "--out", str(out)]
    for o in small:
        args += ["--override", o]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=230,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "| demo-pipelined-0 | 2 |" in res.stdout and "| demo-sync-0 | 2 |" in res.stdout
    results = json.loads((out / "results-demo.json").read_text())
    assert results["demo"]["targets"] == [0.0]
    for mode in ("pipelined", "sync"):
        run = results["demo"]["runs"][mode][0]
        assert run["ok"] and run["steps"] == 2 and run["samples"] == 2 * 2 * 4
        assert run["samples_per_s"] > 0 and run["evals"]
    # target 0 is met by the first evaluation in both modes, so the time ratio is a number
    assert "sync / pipelined: n/a" not in res.stdout and "time to 0.0% held-out accuracy" in res.stdout
    assert (out / "results-demo.md").read_text().startswith("`bench/pipeline.py --workloads demo")
