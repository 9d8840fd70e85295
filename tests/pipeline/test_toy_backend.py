"""`inflight train` with a fourth backend that the core does not know: tests/toy_backend.py, registered from its own
module and named in INFLIGHT_BACKENDS. The launcher starts its server through its launcher with its own options, the
trainer pushes through its protocol client and the actor reads replies with its adapter; two steps, real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.pipeline_helpers import base_overrides, records

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_train_launches_a_registered_backend_end_to_end(tiny_model_dir, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "INFLIGHT_BACKENDS": "tests.toy_backend",
           "TOY_BACKEND_MARKS": str(marks), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = base_overrides(tiny_model_dir, tmp_path, "toy", "server.engine=toy", "trainer.protocol=toy",
                          "actor.adapter=toy", "server.num_servers=1", "server.max_batch=6",
                          "server.max_model_len=160", "pipeline.max_steps=2", "pipeline.startup_timeout_s=120")
    res = subprocess.run([sys.executable, "-m", "inflight.cli", "train", "/dev/null", *args], capture_output=True,
                         text=True, timeout=300, env=env)
    run = tmp_path / "toy"
    assert res.returncode == 0, res.stderr[-3000:] + (run / "logs" / "server0.log").read_text()[-2000:]
    assert [r["step"] for r in records(run, "train_step")] == [1, 2]
    assert [r["step"] for r in records(run, "weight_push")] == [1, 2]
    versions = [r["weight_version"] for r in records(run, "server_metrics")]
    assert versions and versions[-1] == 2
    # every part came from the registration, each in its own role's process
    found = {p.name.split("-")[0]: p for p in marks.iterdir()}
    assert set(found) == {"server", "protocol", "adapter"}, sorted(p.name for p in marks.iterdir())
    assert found["server"].read_text() == "slots=6 context=160"  # server.* mapped onto the toy's own options
    assert found["protocol"].read_text() == "http://127.0.0.1:" + str(int(
        next(a for a in args if a.startswith("server.base_port=")).split("=")[1]))
    pids = {p.name.split("-")[1] for p in found.values()}
    assert len(pids) == 3  # server, trainer and actor: three processes
