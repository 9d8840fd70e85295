"""report.html from metrics.jsonl (one run and a comparison), the metrics logger, and docs/configuration.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from inflight.pipeline.config_docs import DOC_PATH, render
from inflight.pipeline.scrape import parse_prometheus
from inflight.report.metrics import MetricsLogger, MetricsTail, read_metrics
from inflight.report.page import Run, summary, write_report


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
    # the summary's headers break after an underscore (the demo's 14 columns fit a 1300-px window, checked in
    # headless Chromium) and a still wider table scrolls in its own box, not the page
    assert "<div class='wide'><table><tr><th>run</th>" in html and "<th>last_<wbr>accuracy</th>" in html
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


def test_demo_result_line_tells_how_completions_end():
    from inflight.pipeline.demo import result_line

    line = result_line({"first_accuracy": 30.0, "last_accuracy": 70.0, "best_accuracy": 72.5, "wall_s": 360.0,
                        "completion_len_last": 5.04, "truncated_pct_last": 0.4})
    assert line.endswith("; at the end 5.0 tokens per completion, 0.4% cut off by max_new_tokens")


def test_report_shows_lengths_and_escaped_replies(tmp_path):
    """Completion lengths per step, the late truncated share in the summary, and the held-out replies of a few
    evaluations: model output is escaped, never markup."""
    from inflight.report.replies import pick

    run = tmp_path / "run"
    trainer, actor = MetricsLogger(run, "trainer"), MetricsLogger(run, "actor")
    for k in range(1, 21):
        cut = 0.05 * k  # a policy drifting into the limit
        trainer.log("train_step", step=k, reward_mean=0.5, samples_total=8 * k, elapsed_s=float(k),
                    completion_len_mean=6 + 0.3 * k, completion_len_min=4, completion_len_max=12,
                    truncated_frac=cut, eos_frac=1 - cut)
        if k % 3 == 0:
            replies = [{"prompt": "1+2=", "reply": f"\\boxed{{3}}<script>alert({k})</script> & \n\x1b",
                        "finish": "length", "tokens": 12, "label": "truncated"},
                       {"prompt": "4+4=", "reply": "\\boxed{8}", "finish": "stop", "tokens": 5, "label": "correct"}]
            actor.log("eval", step=k, trainer_version=k, accuracy=0.5, truncated_frac=cut, replies=replies)
    trainer.log("warning", step=20, kind="truncation", message="cut off")
    for log in (trainer, actor):
        log.close()
    html = write_report([run]).read_text()
    assert (run / "plots" / "lengths.png").stat().st_size > 1000 and "plots/lengths.png" in html
    assert "<script>" not in html and "\\boxed{3}&lt;script&gt;alert(18)&lt;/script&gt; &amp; ↵\n\\x1b" in html
    shown = [k for k in (3, 6, 9, 12, 15, 18) if f"trainer version {k}," in html]
    assert shown == [3, 9, 12, 18]  # the first, the last and evenly spaced ones between
    assert "cut off (max_new_tokens)" in html and "ended (EOS)" in html
    s = summary(Run(run))
    assert abs(s["truncated_pct_last"] - 97.5) < 1e-9  # the last 10% of 20 steps: 95% and 100%
    assert abs(s["completion_len_last"] - 11.85) < 1e-9 and s["warnings"] == 1
    assert pick(list(range(10)), 4) == [0, 3, 6, 9] and pick([1, 2], 4) == [1, 2]


def test_accuracy_plot_draws_each_evaluation_with_its_stderr_band(tmp_path):
    """The band around the accuracy curve spans accuracy +- stderr at every evaluation, on both axes; a record
    without `stderr` (older runs) gets the binomial one from num_problems."""
    import math

    from inflight.report.page import figure

    actor, trainer = MetricsLogger(tmp_path, "actor"), MetricsLogger(tmp_path, "trainer")
    MetricsLogger(tmp_path, "launcher").log("run_start")
    points = [(0.25, 200, 0.030619), (0.5, 50, 0.0707107), (0.8, 50, None)]  # (accuracy, problems, stderr)
    for k, (acc, n, se) in enumerate(points, 1):
        trainer.log("train_step", step=k, samples_total=100 * k)
        actor.log("eval", step=k, accuracy=acc, num_problems=n, **({} if se is None else {"stderr": se}))
    actor.close()
    trainer.close()
    fig = figure("accuracy", [Run(tmp_path)])
    want = [100 * (se if se is not None else math.sqrt(acc * (1 - acc) / n)) for acc, n, se in points]
    for ax in fig.axes:
        (x, y) = ax.lines[0].get_data()
        assert list(y) == pytest.approx([100 * a for a, _, _ in points])
        (band,) = ax.collections
        verts = band.get_paths()[0].vertices
        for xv, yv, e in zip(x, y, want, strict=True):
            at = verts[abs(verts[:, 0] - xv) < 1e-9][:, 1]
            assert min(at) == pytest.approx(yv - e, abs=1e-6) and max(at) == pytest.approx(yv + e, abs=1e-6)
    assert summary(Run(tmp_path))["last_stderr"] == pytest.approx(want[-1])


def test_best_accuracy_rests_on_the_whole_split_not_the_luckiest_subset(tmp_path):
    """With rotating subsets, the best is the best whole-split evaluation or run of subsets covering the split."""
    actor = MetricsLogger(tmp_path, "actor")
    MetricsLogger(tmp_path, "launcher").log("run_start")
    evals = [(0.30, 200), (0.60, 100), (0.90, 100), (0.70, 100), (0.72, 200)]  # base, 3 subsets of 100, final
    for k, (acc, n) in enumerate(evals):
        actor.log("eval", step=k, accuracy=acc, num_problems=n, split_size=200)
    actor.close()
    s = summary(Run(tmp_path))
    assert s["best_accuracy"] == pytest.approx(100 * (0.90 + 0.70) / 2)  # not the single subset's 90%
    assert s["last_accuracy"] == pytest.approx(72.0)


def test_smoothing_is_a_debiased_ema_like_tensorboards():
    """ema() against a float64 reference written out here: the closed form of the debiased EMA, each point the
    weighted mean of the values so far with weights (1 - w) w^(k - j), normalised by their sum 1 - w^(k + 1)."""
    import numpy as np

    from inflight.report.page import ema, smoothing_weight

    rng = np.random.default_rng(0)
    y = np.cumsum(rng.normal(size=300)) + 5.0 * rng.standard_cauchy(size=300).clip(-20, 20)
    for w in (0.0, 0.6, 0.9, 0.98):
        ref = np.empty_like(y)
        for k in range(len(y)):
            weights = (1.0 - w) * w ** np.arange(k, -1, -1, dtype=np.float64)
            ref[k] = np.dot(weights, y[: k + 1]) / (1.0 - w ** (k + 1))
        assert np.allclose(ema(y.tolist(), w), ref, rtol=1e-12, atol=1e-9)
    assert ema([3.0] * 50, 0.9) == pytest.approx([3.0] * 50, rel=1e-12)  # debiased: no ramp up from 0
    assert ema([1.0, float("nan"), 3.0], 0.5)[1] != ema([1.0, float("nan"), 3.0], 0.5)[1]  # NaN passes through
    assert ema([1.0, float("nan"), 3.0], 0.5)[2] == pytest.approx((0.25 * 1 + 0.5 * 3) / 0.75)
    with pytest.raises(ValueError, match="smoothing weight"):
        ema([1.0], 1.0)
    assert smoothing_weight(5) == 0.6 and smoothing_weight(100) == pytest.approx(0.9) and smoothing_weight(10**5) == 0.98


def test_per_step_plots_draw_the_raw_points_faint_and_their_ema_on_top(tmp_path):
    """The trainer plot: raw tokens/s faint, the EMA of them in full; a few outliers (the first step's start-up
    wait) stay off the scale, and the legend says how many."""
    from inflight.report.page import RAW_ALPHA, ema, figure, smoothing_weight

    trainer = MetricsLogger(tmp_path, "trainer")
    MetricsLogger(tmp_path, "launcher").log("run_start")
    tps = [1000.0 + 100 * ((7 * k) % 5) for k in range(60)]
    waits = [30.0] + [0.1 + 0.01 * (k % 3) for k in range(59)]  # the first step waits for the servers to start
    for k in range(60):
        trainer.log("train_step", step=k + 1, samples_total=8 * (k + 1), tokens_per_s=tps[k], wait_s=waits[k])
    trainer.close()
    fig = figure("trainer", [Run(tmp_path)])
    raw, smooth = fig.axes[0].lines[:2]
    assert raw.get_alpha() == RAW_ALPHA and list(raw.get_ydata()) == tps
    assert list(smooth.get_ydata()) == pytest.approx(ema(tps, smoothing_weight(60)), rel=1e-12)
    wait_ax = fig.axes[1]
    assert wait_ax.get_ylim()[1] < 1.0  # not stretched to 30 s by one step
    assert any("off scale: 1 above (up to 30)" in t.get_text() for t in wait_ax.get_legend().get_texts())
    assert fig.axes[0].get_ylim()[1] > max(tps)  # nothing to leave off here


def test_accuracy_plot_draws_the_whole_split_and_each_window_faint(tmp_path):
    """Rotating windows of 50 of 200 problems: the main line is the whole-split accuracy (the base, then the mean of
    each last full rotation of 4 windows, then the final evaluation), the windows' own scores faint behind it."""
    from inflight.report.page import RAW_ALPHA, figure

    actor, trainer = MetricsLogger(tmp_path, "actor"), MetricsLogger(tmp_path, "trainer")
    MetricsLogger(tmp_path, "launcher").log("run_start")
    evals = [(0.30, 200), (0.60, 50), (0.80, 50), (0.70, 50), (0.90, 50), (0.50, 50), (0.72, 200)]
    for k, (acc, n) in enumerate(evals):
        trainer.log("train_step", step=k, samples_total=100 * k)
        actor.log("eval", step=k, accuracy=acc, num_problems=n, split_size=200, samples_total=100 * k,
                  base=k == 0, final=k == len(evals) - 1)
    actor.close()
    trainer.close()
    want = [30.0, 100 * (0.6 + 0.8 + 0.7 + 0.9) / 4, 100 * (0.8 + 0.7 + 0.9 + 0.5) / 4, 72.0]  # 30, 75, 72.5, 72
    fig = figure("accuracy", [Run(tmp_path)])
    main, windows = fig.axes[1].lines  # vs samples trained
    assert list(main.get_xdata()) == [0, 400, 500, 600] and list(main.get_ydata()) == pytest.approx(want)
    assert windows.get_alpha() == RAW_ALPHA and list(windows.get_xdata()) == [100, 200, 300, 400, 500]
    assert list(windows.get_ydata()) == pytest.approx([60, 80, 70, 90, 50])
    assert "one window (50 of 200 problems)" in windows.get_label()
    band = fig.axes[1].collections[0].get_paths()[0].vertices  # a rotation's stderr rests on the 200 problems
    at = band[abs(band[:, 0] - 400) < 1e-9][:, 1]
    assert max(at) - 75 == pytest.approx(100 * (0.75 * 0.25 / 200) ** 0.5)
    s = summary(Run(tmp_path))
    assert s["best_accuracy"] == pytest.approx(75.0) and s["last_accuracy"] == pytest.approx(72.0)


def test_lr_plot_appears_when_the_trainer_logs_lr(tmp_path):
    """A run whose train_step records carry `lr` gets lr.png (the schedule from 0, and the gradient norm); one
    without gets no empty plot."""
    from inflight.report.page import figure

    with_lr, without = tmp_path / "with", tmp_path / "without"
    for run, lr in ((with_lr, True), (without, False)):
        trainer = MetricsLogger(run, "trainer")
        for k in range(1, 31):
            extra = {"lr": 1e-3 * (1 - k / 30), "grad_norm": 1.0 + k % 3} if lr else {}
            trainer.log("train_step", step=k, samples_total=8 * k, reward_mean=0.5, **extra)
        trainer.close()
    html = write_report([with_lr]).read_text()
    assert (with_lr / "plots" / "lr.png").stat().st_size > 1000 and "plots/lr.png" in html
    assert "Learning-rate schedule" in html
    html = write_report([without]).read_text()
    assert not (without / "plots" / "lr.png").exists() and "lr.png" not in html
    ax = figure("lr", [Run(with_lr)]).axes[0]
    assert list(ax.lines[0].get_ydata()) == pytest.approx([1e-3 * (1 - k / 30) for k in range(1, 31)])
    assert ax.get_ylim()[0] == 0.0
    # comparing runs: the plot is there when one of them logged lr
    assert "plots/lr.png" in write_report([without, with_lr], tmp_path / "cmp").read_text()
