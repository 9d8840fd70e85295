"""The GPU scripts cannot run here end to end on a GPU; what CI can hold them to: every shell script parses and is
executable, the Python drivers' options parse, both refuse `--device cuda` on a machine without the GPUs they ask
for, the window's command (scripts/gpu-run.sh) runs the bench's CPU dry run (every stage, small) as on the GPU
image and writes every figure, the bench names the stage that failed, its servers end with their stage, and the
goals are judged only where the figure means what the goal means."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
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
    """The window's command, scripts/gpu-run.sh, with --device cpu --tiny and every Python process seeing only what
    the GPU image holds and the carried wheels (scripts/image_guard): the imports check passes, every stage runs,
    every figure has a value and its goal, and the four files land in DEST. A figure the CPU cannot measure as the
    goal means it is not judged (met None, with the reason); float32 on CPU makes both logprob checks exact to float
    rounding, and those are judged."""
    sys.path.insert(0, str(SCRIPTS))
    from bench_common import GOALS, NOT_ON_CPU

    dest, work = tmp_path / "dest", tmp_path / "work"
    env = {**os.environ, "DEST": str(dest), "WORK": str(work), "PYTHON": sys.executable, "WHEELS": str(tmp_path),
           "INFLIGHT_AS_GPU_IMAGE": "1", "PYTHONPATH": os.pathsep.join(
               filter(None, [str(SCRIPTS / "image_guard"), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(["bash", str(SCRIPTS / "gpu-run.sh"), "--device", "cpu", "--tiny"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "modules import" in p.stdout
    assert sorted(x.name for x in dest.iterdir()) == ["bench-files.tar.gz", "bench.json", "bench.log", "gpu-run.log"]
    with tarfile.open(dest / "bench-files.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./stage-engine.json", "./server-push.log", "./pipeline-sync.log", "./pipeline/sync/metrics.jsonl"} <= names
    bench = json.loads((dest / "bench.json").read_text())
    assert {s: v["ok"] for s, v in bench["stages"].items()} == dict.fromkeys(
        ["models", "engine", "trainer", "push", "pipeline"], True)
    for key, (_, goal, how) in GOALS.items():
        f = bench[key]
        assert f["value"] is not None and f["goal"] == goal, (key, f)
        if key in NOT_ON_CPU:
            assert f["met"] is None and f["reason"] == NOT_ON_CPU[key], (key, f)
            continue
        want = True if goal is None else (f["value"] >= goal if how == ">=" else f["value"] <= goal)
        assert f["met"] is want, (key, f)
    assert set(GOALS) - set(NOT_ON_CPU) == {"engine_logprob_max_diff", "trainer_logprob_max_diff"}
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
    assert "Self CPU" in (dest / "bench.log").read_text()  # the profiler's table, in the log


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


def test_judged_only_where_the_figure_means_the_goal():
    sys.path.insert(0, str(SCRIPTS))
    from bench_common import bf16_peak, judged

    assert judged("push_s", 0.04, device="cuda") == {"value": 0.04, "goal": 0.05, "met": True}
    cpu = judged("push_s", 0.04, device="cpu")
    assert cpu["met"] is None and "CPU dry run" in cpu["reason"]
    assert judged("trainer_logprob_max_diff", 2e-3, device="cpu")["met"] is False  # float32 on CPU: judged
    assert judged("push_s", None, device="cpu") == {"value": None, "goal": 0.05, "met": False}  # not measured
    assert judged("trainer_mfu", 0.3, device="cuda", unjudged="peak unknown")["met"] is None
    assert bf16_peak("NVIDIA H100 80GB HBM3") == bf16_peak("NVIDIA H200") == 989e12
    assert bf16_peak("NVIDIA H100 PCIe") == 756e12 and bf16_peak("NVIDIA H100 NVL") == 835e12
    assert bf16_peak("NVIDIA A100-SXM4-80GB") is None


def test_a_server_ends_with_its_stage(tmp_path):
    """scripts/with_parent.py (the bench's servers start through it, each in a session of its own): when the stage
    that started it dies, even by SIGKILL, the command's process group is stopped."""
    pid_file = tmp_path / "pid"
    stage = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
p = subprocess.Popen([sys.executable, {str(SCRIPTS / "with_parent.py")!r}, sys.executable, "-c",
                      "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"],
                     start_new_session=True)
time.sleep(120)
"""])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        server = int(pid_file.read_text())
        os.kill(server, 0)  # running
    finally:
        stage.send_signal(signal.SIGKILL)
        stage.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(server, signal.SIGKILL)
    raise AssertionError("the command outlived the process that started it")
