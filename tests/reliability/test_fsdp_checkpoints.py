"""FSDP2 checkpoints of a resumed run (2 gloo ranks, tied embeddings). The trainer of a resumed run was built from a
checkpoint folder that pruning deletes two checkpoints later: its saves must not need that folder, and they write
the same HF folder (config, generation config, tied weights) as the model it started from. The resume hands the
optimizer state to rank 0 only, and every rank ends with exactly its shard of the saved state."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.reliability.pipeline_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def resumed_run(tied_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_ckpt")
    run, out, port, procs = tmp / "run", tmp / "out", free_port(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("fsdp_checkpoint_worker.py")), str(tied_model_dir),
             str(run), str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("FSDP2 ranks timed out")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return run, out, [p.returncode for p in procs], logs


@pytest.mark.slow  # ~35 s: two processes build two sharded trainers each and write four checkpoints
def test_resumed_fsdp2_run_keeps_checkpointing(resumed_run, tied_model_dir):
    run, out, codes, logs = resumed_run
    assert codes == [0, 0], "\n".join(x[-3000:] for x in logs)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000003", "step_000004"]  # step_000001 pruned
    final = torch.load(f"{out}.pt", weights_only=True)
    saved = AutoModelForCausalLM.from_pretrained(ckpts / "step_000004", dtype=torch.float32)
    assert saved.lm_head.weight is saved.model.embed_tokens.weight
    assert sorted(n for n, _ in saved.named_parameters()) == sorted(final)
    for n, p in saved.named_parameters():
        assert torch.equal(p.detach(), final[n]), n
    for name in ("config.json", "generation_config.json"):
        assert json.loads((ckpts / "step_000004" / name).read_text()) == json.loads((tied_model_dir / name).read_text())


@pytest.mark.slow
def test_resume_loads_optimizer_state_on_rank0_only(resumed_run):
    run, out, codes, logs = resumed_run
    got = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["handed"] == [got[0]["params"]] and got[1]["handed"] == [0], got  # rank 1 reads no optimizer state
    for g in got:  # every rank holds exactly its shard of the saved moments
        assert g["compared"] == 2 * g["params"] and g["max_diff"] == 0.0
