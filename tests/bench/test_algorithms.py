"""bench/algorithms.py: every algorithm's settings make a valid run config, and the table's columns (mean and
spread over seeds, the shared evaluation step, samples/s, tokens per completion) from runs written by the real
metrics logger."""

from __future__ import annotations

import importlib.util
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from inflight.report.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("bench_algorithms", REPO / "bench" / "algorithms.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_algorithm_is_a_valid_config():
    from inflight.algo import make_loss
    from inflight.config import RunConfig, load_config
    from inflight.pipeline.launch_common import check_ranks

    b = load()
    assert list(b.ALGORITHMS)[0] == "grpo" and b.ALGORITHMS["grpo"] == []
    seen = set()
    for name, overrides in b.ALGORITHMS.items():
        cfg = load_config(RunConfig, REPO / "configs" / "cpu-demo.yaml", overrides)
        # refuses unknown values and bad combinations (a constant normaliser of 0 is the trainer's max_new_tokens)
        make_loss(replace(cfg.algo, norm_constant=cfg.algo.norm_constant or cfg.actor.max_new_tokens))
        check_ranks(cfg)
        key = (cfg.algo.loss, cfg.algo.advantage, cfg.algo.normalization, cfg.algo.is_mask, cfg.actor.dynamic_sampling)
        assert key not in seen, f"{name} runs the same settings as another row"
        seen.add(key)


def write_run(run_dir: Path, evals: dict[int, float], final: float, lengths: list[float], samples: int,
              elapsed: float) -> None:
    actor, trainer = MetricsLogger(run_dir, "actor"), MetricsLogger(run_dir, "trainer")
    actor.log("eval", step=0, accuracy=0.3, base=True, trainer_version=0)
    for k, n in enumerate(lengths, 1):
        trainer.log("train_step", step=k, samples_total=samples * k // len(lengths), completion_len_mean=n,
                    elapsed_s=elapsed * k / len(lengths))
    for step, acc in evals.items():
        actor.log("eval", step=step + 1, accuracy=acc, trainer_version=step + 1)
    actor.log("eval", step=99, accuracy=final, final=True, trainer_version=99)
    actor.close()
    trainer.close()


def test_table_of_means_spreads_and_the_shared_step(tmp_path):
    b = load()
    # grpo's seeds reached step 20, gspo's second seed only step 10: the shared point is step 10
    write_run(tmp_path / "grpo-seed0", {10: 0.5, 20: 0.6}, 0.70, [8.0, 7.0], 640, 32.0)
    write_run(tmp_path / "grpo-seed1", {10: 0.4, 20: 0.7}, 0.60, [9.0, 8.0], 640, 64.0)
    write_run(tmp_path / "gspo-seed0", {10: 0.55, 20: 0.65}, 0.75, [6.0, 6.0], 320, 32.0)
    write_run(tmp_path / "gspo-seed1", {10: 0.45}, 0.65, [10.0], 320, 16.0)
    figures = {a: [b.run_figures(tmp_path / f"{a}-seed{s}", 10) for s in (0, 1)] for a in ("grpo", "gspo")}
    assert figures["grpo"][0]["samples_per_s"] == pytest.approx(20.0)
    assert figures["grpo"][1]["tokens_per_completion"] == pytest.approx(8.5)
    assert b.common_step(figures) == "step 10"
    rows = {r["algorithm"]: r for r in b.table(figures)}
    assert rows["grpo"]["final"] == pytest.approx([70.0, 60.0]) and rows["grpo"]["at_step"] == pytest.approx([50.0, 40.0])
    assert statistics.fmean(rows["gspo"]["samples_per_s"]) == pytest.approx((10.0 + 20.0) / 2)
    text = b.render(list(rows.values()))
    assert "| algorithm | seeds | final % | at step 10 % | samples/s | tokens/compl |" in text
    assert "| grpo | 2 | 65.0 ± 5.0 | 45.0 ± 5.0 | 15.0 | 8.0 |" in text
    assert "| gspo | 2 | 70.0 ± 5.0 | 50.0 ± 5.0 | 15.0 | 8.0 |" in text
