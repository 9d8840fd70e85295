"""bench/peers.py starts, runs each system a few steps on the random tiny model and prints its table. TRL runs
too when its venv (.cache/peers/trl, `bench/peers.py --setup`) exists; without it only the inflight systems run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRL_PY = REPO / ".cache" / "peers" / "trl" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_peers_prints_a_table(tiny_model_dir, tmp_path):
    # pipelined with an override stands for plain pipelined too: one run fewer (CI's time budget)
    systems = (["trl"] if TRL_PY.exists() else []) + ["pipelined:actor.max_lag=2", "sync"]
    cmd = [sys.executable, str(REPO / "bench" / "peers.py"), "--model", str(tiny_model_dir), "--run-dir",
           str(tmp_path), "--systems", ",".join(systems), "--repeats", "1", "--minutes", "1", "--max-steps", "4",
           "--eval-every", "2", "--target", "0.0"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=580)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert out.startswith("machine: ") and "command: " in out
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| ((?:trl|pipelined|sync)[\w:.=]*) \| (.*)\|$", out, re.M)}
    assert sorted(rows) == sorted(systems), out
    for system in systems:  # at the start, then every 2 steps (inflight: its checkpoints, scored afterwards)
        evals = re.search(rf"^  {re.escape(system)} r0: 4 steps, evals \[(.*)\]$", out, re.M)
        assert evals and len(evals.group(1).split(",")) == 3, (system, out)
    for system, row in rows.items():
        cells = [c.strip() for c in row.split("|")]
        assert float(cells[0].split()[0]) > 0, (system, row)  # samples/s
        assert cells[2].split()[0] == "512", (system, row)  # 4 steps x 128 samples trained
        assert cells[3] != "not reached", (system, row)  # target 0 is reached at the first evaluation
        assert 0 <= float(cells[6].split()[0]) <= 100, (system, row)  # the learning curve's mean accuracy
        assert 0 <= float(cells[10].split()[0].rstrip("%")) <= 100, (system, row)  # completions cut off
        assert float(cells[11].split()[0]) > 0, (system, row)  # executed MFLOP per sample
        share = float(cells[12].split()[0].rstrip("%"))
        assert 0 < share < 100, (system, row)  # no run beats the machine's matmul peak
    saved = json.loads((tmp_path / "peers-results.json").read_text())
    assert sorted(saved["runs"]) == sorted(systems) and all(len(saved["runs"][s][0]["evals"]) == 3 for s in systems)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generation_bench_prints_a_table():
    cmd = [sys.executable, str(REPO / "bench" / "peers" / "generation.py"), "--concurrency", "4", "--repeats", "1"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = re.findall(r"^\| 4 \| (inflight|hf_generate|hf_cb) \| (\d+) \| ([\d.]+)x \| ([\d.]+) \| ([\d.]+) \|$",
                      res.stdout, re.M)
    assert sorted(r[0] for r in rows) == ["hf_cb", "hf_generate", "inflight"], res.stdout
    for name, tok_s, ratio, p50, p99 in rows:
        assert int(tok_s) > 0 and 0 < float(p50) <= float(p99), (name, tok_s, p50, p99)
    assert [r[2] for r in rows if r[0] == "hf_generate"] == ["1.00"]  # HF generate against itself
