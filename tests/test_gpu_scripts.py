"""The GPU scripts cannot run here end to end on a GPU; what CI can hold them to: every shell script parses and is
executable, the Python drivers' options parse, both refuse `--device cuda` on a machine without the GPUs they ask
for, and the bench's CPU dry run (every stage, small) writes every figure, and names the stage that failed."""

from __future__ import annotations

import json
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


def test_bench_refuses_cuda_without_gpu(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPTS / "gpu_bench.py"), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--stages" in p.stdout and "--tiny" in p.stdout, p.stderr
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = subprocess.run([sys.executable, str(SCRIPTS / "gpu_bench.py"), "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "no GPU" in p.stdout, p.stdout + p.stderr


def run_bench(out, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPTS / "gpu-bench.sh"), "--device", "cpu", "--tiny", *args], env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_bench_dry_run_reports_every_figure(tmp_path):
    """scripts/gpu-bench.sh --device cpu --tiny: every stage runs, every figure has a value, its goal, and `met`
    judged against that goal; float32 on CPU makes both logprob checks exact to float rounding."""
    sys.path.insert(0, str(SCRIPTS))
    from bench_common import GOALS

    p = run_bench(tmp_path)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert {s: v["ok"] for s, v in bench["stages"].items()} == dict.fromkeys(
        ["models", "engine", "trainer", "push", "pipeline"], True)
    for key, (_, goal, how) in GOALS.items():
        f = bench[key]
        assert f["value"] is not None and f["goal"] == goal, (key, f)
        want = True if goal is None else (f["value"] >= goal if how == ">=" else f["value"] <= goal)
        assert f["met"] is want, (key, f)
    assert bench["engine_logprob_max_diff"]["value"] < 1e-4
    assert bench["engine_logprob_max_diff"]["context"]["logprob_mean_abs_diff_old_weights"] > 0.01
    assert bench["trainer_logprob_max_diff"]["value"] < 1e-4
    assert bench["engine_tokens_per_s_64"]["value"] > 0 and bench["engine_step_ms_vs_floor_64"]["value"] > 1
    assert bench["engine_tokens_per_s_64"]["context"]["decode_path"].startswith("eager")  # CPU: no CUDA graphs
    assert set(bench["push_s"]["context"]["transports"]) >= {"process_group", "shm"}
    top = bench["trainer_tokens_per_s"]["context"]["profile_top"]
    assert top and all(e["self_ms"] >= 0 and e["calls"] >= 1 for e in top)
    runs = bench["pipelined_vs_sync_samples"]["context"]["runs"]
    assert runs["pipelined"]["steps"] == runs["sync"]["steps"] == 4
    assert "Self CPU" in (tmp_path / "bench.log").read_text()  # the profiler's table, in the log


def test_bench_names_the_failed_stage_and_keeps_the_json(tmp_path):
    p = run_bench(tmp_path, "--stages", "pipeline", "--pipeline-set", "actor.no_such_option=1")
    assert p.returncode == 1 and "FAILED stage(s): pipeline" in p.stdout, p.stdout[-3000:]
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert list(bench["stages"]) == ["pipeline"] and "no_such_option" in bench["stages"]["pipeline"]["error"]
    assert bench["pipelined_vs_sync_samples"] == {"value": None, "goal": None, "met": False}
    assert "engine_tokens_per_s_64" not in bench  # stages not asked for report nothing


def test_cuda_graphs_check_dry_run_on_cpu(tmp_path):
    """scripts/check_cuda_graphs.py end to end on CPU (graphs replayed eagerly): every part runs and its checks
    hold; on a GPU the same script captures the graphs and measures."""
    p = subprocess.run([sys.executable, str(SCRIPTS / "check_cuda_graphs.py"), "--out", str(tmp_path), "--device",
                        "cpu", "--tiny", "--streams", "2,4", "--new-tokens", "8"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "cuda_graphs.json").read_text())
    assert res["capture"] == "eager replay" and "failed" not in res
    assert res["match"]["same_tokens"] == 1.0 and res["match"]["max_logprob_diff"] < 1e-5
    assert res["push"]["moved"] == [] and res["push"]["same_tokens"] == 1.0
    assert set(res["speed"]) == {f"{m}_{n}_tokens_per_s" for m in ("off", "on") for n in (2, 4)}
