"""bench/lengths.py: the length curve of a run as a table, per tenth of its steps (new and old metrics)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_lengths_table(tmp_path):
    new, old = tmp_path / "new", tmp_path / "old"
    for d in (new, old):
        d.mkdir()
    recs = [{"event": "train_step", "step": k, "completion_len_mean": 6.0 + (k > 10),
             "truncated_frac": 0.5 * (k > 10), "tokens": 1, "samples": 1} for k in range(1, 21)]
    recs += [{"event": "eval", "accuracy": a} for a in (0.3, 0.8, 0.7)]
    (new / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    recs = [{"event": "train_step", "step": k, "tokens": 8 * (12 if k > 5 else 7), "samples": 8}
            for k in range(1, 11)]
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "lengths.py"), str(new), str(old)], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[2] == "| new | 20 | 30.0 / 80.0 / 70.0 | mean length | " + " | ".join(["6.00"] * 5 + ["7.00"] * 5) + " |"
    assert out[3] == "| new | 20 | 30.0 / 80.0 / 70.0 | cut off (%) | " + " | ".join(["0.0"] * 5 + ["50.0"] * 5) + " |"
    assert out[4].endswith("| mean length | " + " | ".join(["7.00"] * 5 + ["12.00"] * 5) + " |")
    assert out[5].endswith("| cut off (%) | " + " | ".join(["-"] * 10) + " |")
