"""FSDP2 checkpoints of a resumed run (2 gloo ranks, tied embeddings). The trainer of a resumed run was built from a
checkpoint folder that pruning deletes two checkpoints later: its saves must not need that folder, and they write
the same HF folder (config, generation config, tied weights) as the model it started from. The resume hands the
optimizer state to rank 0 only (the other ranks map the file and never read it), and every rank ends with exactly
its shard of the saved state."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer.cpu_collectives import run_ranks

WORKER = Path(__file__).with_name("fsdp_checkpoint_worker.py")


@pytest.fixture(scope="module")
def resumed_run(tied_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_ckpt")
    run, out = tmp / "run", tmp / "out"
    run_ranks(WORKER, [tied_model_dir, run, out])  # fails both tests unless every rank exits 0
    return run, out


@pytest.mark.slow  # ~35 s: two processes build two sharded trainers each and write four checkpoints
def test_resumed_fsdp2_run_keeps_checkpointing(resumed_run, tied_model_dir):
    run, out = resumed_run
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
    run, out = resumed_run
    got = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["handed"] == [got[0]["params"]] and got[1]["handed"] == [0], got  # rank 1 reads no optimizer state
    for g in got:  # every rank holds exactly its shard of the saved moments
        assert g["compared"] == 2 * g["params"] and g["max_diff"] == 0.0


@pytest.mark.slow
def test_resume_maps_the_optimizer_state_and_only_rank0_reads_it(resumed_run):
    """Every rank gets the optimizer tensors as a mapping of the checkpoint's file; rank 0 reads them (its pages
    come in), rank 1 never touches them: its resident part of the mapping stays a few pages, not the file."""
    run, out = resumed_run
    got = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    size = got[0]["optimizer_bytes"]
    assert size == got[1]["optimizer_bytes"] > 500_000, got  # 2 moments x ~85k float32 parameters
    assert got[0]["mapped"] and got[1]["mapped"], got
    assert got[0]["resident"] >= size, got  # rank 0 read every moment through the mapping
    assert got[1]["resident"] <= size // 4, got  # the RNG state's pages and the kernel's 64 kB fault-around
