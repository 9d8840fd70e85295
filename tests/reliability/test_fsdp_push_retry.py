"""FSDP2 pushes retry like the single trainer's: 2 gloo ranks, a real `inflight serve` restarted after the weight
group was formed (its first update answers 409), the loop forms the group again and resends. Every rank gathers
the weights once for the push (a retry never re-enters the collective), and the server ends at the version with
exactly the gathered weights (its logprobs against a float64 reference)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inflight.engine.serve import ServerProcess
from tests.reliability.pipeline_helpers import free_port, records
from tests.reliability.test_weight_update_faults import SERVE
from tests.test_lora_push import max_error

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two server start-ups and two sharded trainers (~40 s on 2 shared cores)
def test_fsdp2_push_refused_once_is_retried(tiny_model_dir, tmp_path):
    out, run = tmp_path / "rank0.pt", tmp_path / "run"
    server = ServerProcess(str(tiny_model_dir), extra_args=SERVE)
    port, procs = free_port(), []
    try:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("fsdp_push_worker.py")), str(tiny_model_dir), str(run),
                 str(out), server.url, str(server.proc.pid)],
                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=240)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail("FSDP2 ranks timed out (a rank left waiting in a gather?)")
            if p.returncode != 0:  # the other rank would wait for it in a collective
                for q in procs:
                    q.kill()
                break
        assert all(p.returncode == 0 for p in procs), "\n".join(x[-4000:] for x in logs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop()

    retries = records(run, "weight_sync_retry")
    assert retries and "HTTP 409" in retries[0]["error"], retries
    assert [r["step"] for r in records(run, "weight_push")] == [1]
    for rank in range(2):  # the gather ran once on every rank, the retry resent what rank 0 had gathered
        assert json.loads(Path(f"{out}.rank{rank}.json").read_text())["gathers_at_push"] == 1
    got = torch.load(out, weights_only=True)
    assert got["version"] == 1
    assert max_error(tiny_model_dir, got["weights"], got["choice"]) < 1e-3  # the gathered weights, exactly
    from transformers import AutoModelForCausalLM

    start = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()}
    assert max_error(tiny_model_dir, start, got["choice"]) > 1e-2  # the server's start weights do not explain them
