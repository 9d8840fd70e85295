"""report.html from metrics.jsonl (one run and a comparison), the metrics logger, and docs/configuration.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from inflight.pipeline.config_docs import DOC_PATH, render
from inflight.pipeline.metrics import MetricsLogger, MetricsTail, read_metrics
from inflight.pipeline.report import summary, write_report, Run
from inflight.pipeline.scrape import parse_prometheus


def _fake_run(run_dir, steps: int, acc0: float, gain: float) -> None:
    """A run's metrics written through the real logger, as the roles write them."""
    trainer = MetricsLogger(run_dir, "trainer", tensorboard=True)
    actor = MetricsLogger(run_dir, "actor")
    launcher = MetricsLogger(run_dir, "launcher")
    launcher.log("run_start")
    for k in range(1, steps + 1):
        trainer.log("train_step", step=k, reward_mean=0.1 * k, samples_total=32 * k, elapsed_s=float(k),
                    lag_max=k % 2, lag_mean=0.5, lag_hist={"0": 10, "1": 5 * (k % 2)}, tokens_per_s=100.0 + k,
                    wait_s=0.1, push_wait_s=0.0, mixed_version_samples=1)
        trainer.log("weight_push", step=k, push_s=0.01, pause_s=0.02)
        if k % 2 == 0:
            actor.log("eval", step=k, accuracy=acc0 + gain * k / steps)
        launcher.log("server_metrics", server=0, tokens_per_s=50.0 * k, batch_occupancy=0.5, paused_share=0.01)
    trainer.log("trainer_done", step=steps)
    for log in (trainer, actor, launcher):
        log.close()


def test_metrics_logger_lines_and_tail(tmp_path):
    log = MetricsLogger(tmp_path, "trainer")
    tail = MetricsTail(tmp_path)
    log.log("train_step", step=1, loss=float("nan"), x=2)
    assert [r["x"] for r in tail.read_new()] == [2]
    log.log("eval", accuracy=0.5)
    new = tail.read_new()
    assert len(new) == 1 and new[0]["event"] == "eval" and new[0]["role"] == "trainer"
    recs = read_metrics(tmp_path, event="train_step")
    assert recs[0]["loss"] is None and recs[0]["step"] == 1  # NaN is stored as null (valid JSON)
    log.close()


def test_report_single_and_compare(tmp_path):
    a, b = tmp_path / "pipelined", tmp_path / "sync"
    _fake_run(a, 6, 0.3, 0.4)
    _fake_run(b, 4, 0.3, 0.1)
    path = write_report([a])
    html = path.read_text()
    for png in ("accuracy", "reward", "lag_hist", "server_throughput", "pause", "trainer"):
        assert (a / "plots" / f"{png}.png").stat().st_size > 1000
        assert f"plots/{png}.png" in html
    s = summary(Run(a))
    assert s["steps"] == 6 and s["samples"] == 192 and s["lag_max"] == 1
    assert abs(s["first_accuracy"] - 100 * (0.3 + 0.4 * 2 / 6)) < 1e-9
    assert abs(s["last_accuracy"] - 70.0) < 1e-9
    assert any((a / "tensorboard" / "trainer").iterdir())
    out = tmp_path / "cmp"
    res = subprocess.run([sys.executable, "-m", "inflight.cli", "report", str(a), str(b), "--out", str(out)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    rows = json.loads((out / "summary.json").read_text())
    assert [r["run"] for r in rows] == ["pipelined", "sync"]
    assert "report.html" in res.stdout


def test_report_of_missing_run_is_a_clear_error(tmp_path):
    res = subprocess.run([sys.executable, "-m", "inflight.cli", "report", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "metrics.jsonl" in res.stdout


def test_parse_prometheus():
    text = "# HELP x y\n# TYPE x gauge\ninflight_running_requests 3\nfoo{a=\"b\"} 2.5\nbad line here\n"
    assert parse_prometheus(text) == {"inflight_running_requests": 3.0, "foo": 2.5}


def test_configuration_doc_is_up_to_date():
    text = render()
    assert "`pipeline.update_mode`" in text and "`trainer.lr`" in text and "`actor.max_lag`" in text
    assert DOC_PATH.read_text() == text, "run: python -m inflight.pipeline.config_docs"


def test_demo_result_line_rounds_the_percentages():
    from inflight.pipeline.demo import result_line

    line = result_line({"first_accuracy": 28.000000000000004, "last_accuracy": 66.0, "best_accuracy": None,
                        "wall_s": 366.1})
    assert line == "demo: held-out accuracy 28.0% -> 66.0% (best n/a) in 366.1 s of RL"
