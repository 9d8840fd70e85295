"""FSDP2 pushes retry like the single trainer's: 2 gloo ranks, a real `inflight serve` restarted after the weight
group was formed (its first update answers 409), the loop forms the group again and resends. Every rank gathers
the weights once for the push (a retry never re-enters the collective), and the server ends at the version with
exactly the gathered weights (its logprobs against a float64 reference)."""

import json
from pathlib import Path

import pytest
import torch

from inflight.engine.serve import ServerProcess
from tests.reliability.pipeline_helpers import records
from tests.reliability.test_weight_update_faults import SERVE
from tests.test_lora_push import max_error
from tests.trainer.cpu_collectives import run_ranks

WORKER = Path(__file__).with_name("fsdp_push_worker.py")


@pytest.mark.slow  # two server start-ups and two sharded trainers (~40 s on 2 shared cores)
def test_fsdp2_push_refused_once_is_retried(tiny_model_dir, tmp_path):
    out, run = tmp_path / "rank0.pt", tmp_path / "run"
    server = ServerProcess(str(tiny_model_dir), extra_args=SERVE)
    try:
        run_ranks(WORKER, [tiny_model_dir, run, out, server.url, server.proc.pid],
                  hung="FSDP2 ranks timed out (a rank left waiting in a gather?)", tail=4000)
    finally:
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
