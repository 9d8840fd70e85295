"""bench/plan_check.py's arithmetic on a hand-written metrics.jsonl: samples/s after the skipped steps, the lag
histogram, the workload it hands the simulator, and the total-variation distance."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_read_and_tv(tmp_path):
    b = load("plan_check")
    steps = [{"event": "train_step", "time": 100.0 + 0.5 * i, "samples_total": 16 * (i + 1), "samples": 16,
              "lag_hist": {"0": 10, "1": 30} if i % 2 else {"0": 40}, "completion_len_mean": 5.0,
              "completion_len_min": 2, "completion_len_max": 9, "prompt_tokens": 20,
              "group_indices": [2 * i, 2 * i + 1],
              "trained_samples": 12, "train_s": 0.25} for i in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    r = b.read(tmp_path, skip=2)
    assert r["samples_per_s"] == pytest.approx(32 / 1.0)  # steps 3 and 4 over the second after step 2
    assert r["lag"] == {0: 100, 1: 60}
    assert r["prompt_tokens"] == pytest.approx(10.0) and r["trained_frac"] == pytest.approx(0.75)
    assert len(r["lengths"]) == 64 and sum(r["lengths"]) / 64 == pytest.approx(5.0, abs=0.1)
    assert min(r["lengths"]) == 2 and max(r["lengths"]) == 9
    assert b.tv({0: 1}, {0: 5}) == 0.0 and b.tv({0: 1}, {1: 1}) == 1.0
    assert b.tv({0: 3, 1: 1}, {0: 1, 1: 1}) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        b.read(tmp_path, skip=4)
