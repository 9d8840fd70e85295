"""bench/engine.py starts, runs every system for a few tokens and prints its tables (not a measurement)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_engine_bench_prints_its_tables():
    cmd = [sys.executable, str(REPO / "bench" / "engine.py"), "--sizes", "tiny", "--batches", "2", "--new-tokens", "4",
           "--repeats", "2", "--cb-batches", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 2, out.stdout  # decode table and weight-update table
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[1] == "2" and all(c != "-" for c in cells[2:]), rows[0]  # every system measured, every ratio
