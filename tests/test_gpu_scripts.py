"""The GPU scripts cannot run here end to end on a GPU; what CI can hold them to: every shell script parses and is executable, the
Python driver's options parse, and the smoke refuses `--device cuda` on a machine without the GPUs it asks for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_shell_script_parses_and_runs_as_written(name):
    p = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert os.access(SCRIPTS / name, os.X_OK), f"chmod +x scripts/{name} (the docs run it as scripts/{name})"


def test_smoke_driver_options_and_missing_gpu(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPTS / "gpu_smoke.py"), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--tiny" in p.stdout and "--gpus" in p.stdout, p.stderr
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    p = subprocess.run([sys.executable, str(SCRIPTS / "gpu_smoke.py"), "--out", str(tmp_path), "--gpus", "2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "GPU(s)" in p.stdout, p.stdout + p.stderr
