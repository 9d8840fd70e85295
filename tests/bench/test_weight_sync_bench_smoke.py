"""bench/weight_sync.py runs end to end on the tiny preset: one push per transport into a real server, the table
with the memory-copy baseline and the goal line (not a measurement: no times are asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_weight_sync_bench_prints_every_transport():
    p = subprocess.run([sys.executable, "bench/weight_sync.py", "--model", "tiny", "--pushes", "1", "--gap-s", "0"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "goal 2 x copy + 0.1 s" in out
    for transport in ("process group, per tensor", "process group, 16 MB buckets", "| file |", "| shm |"):
        assert transport in out, out
    assert out.count("weight update v") == 4  # the server's own account of each push
