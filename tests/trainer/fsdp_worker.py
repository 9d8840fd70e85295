"""One rank of the FSDP2 test (run as a subprocess with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set).

usage: python fsdp_worker.py MODEL_DIR OUT_FILE [lora]
Trains 3 steps on this rank's share of the samples (see step_samples) and, on rank 0, saves the gathered weights
and per-step stats with torch.save. `lora`: a rank-4 adapter (LORA) from torch seed 0; the saved adapter is
loaded back (collective) and must give the same tensors.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from inflight.config.trainer import LoraConfig, TrainerConfig  # noqa: E402
from inflight.trainer import fsdp as fsdp_module  # noqa: E402
from inflight.trainer.accumulate import StepAccumulator  # noqa: E402
from inflight.trainer.fsdp import FSDP2Trainer  # noqa: E402
from inflight.trainer.loop.fsdp_loop import broadcast_bytes  # noqa: E402
from inflight.trainer.packing import count_loss_tokens  # noqa: E402
from tests.trainer.cpu_collectives import default_group_refuses_cpu_tensors  # noqa: E402
from tests.trainer.helpers import ReinforceLoss, random_samples  # noqa: E402

CFG = dict(lr=1e-3, max_grad_norm=0.5, threads=1, warmup_steps=1, schedule="cosine", total_steps=3)
BUDGET = 40
LORA = dict(rank=4, alpha=8.0)


def step_samples(step: int, vocab: int):
    samples = random_samples(10, vocab, seed=100 + step)
    adv = [((i * 7 + step) % 5) / 2.0 - 1.0 for i in range(10)]
    return samples, adv


def main(model_dir: str, out: str, lora: bool = False) -> None:
    default_group_refuses_cpu_tensors()  # as NCCL would on CUDA: CPU collectives must take t.cpu_group
    loads = []
    real_load = fsdp_module.load_model
    fsdp_module.load_model = lambda *a, **k: loads.append(a) or real_load(*a, **k)
    t = FSDP2Trainer(model_dir, TrainerConfig(backend="fsdp2", lora=LoraConfig(**LORA) if lora else None, **CFG))
    torch.manual_seed(0)  # the adapter's A (rank 0 draws it, as the single-process reference does)
    t.init()
    assert len(loads) == (1 if t.rank == 0 else 0), "only rank 0 reads the checkpoint's weights"
    assert torch.distributed.get_backend(t.cpu_group) == "gloo" and t.cpu_group is not torch.distributed.group.WORLD
    sent = [b"", b"step", bytes(range(256)) * 3] if t.rank == 0 else None
    assert broadcast_bytes(sent, t.rank, t.cpu_group) == [b"", b"step", bytes(range(256)) * 3]
    vocab = t.model.config.vocab_size
    stats = []
    for step in range(3):
        samples, adv = step_samples(step, vocab)
        # uneven split on purpose: rank 0 gets 7 samples, rank 1 gets 3 (different micro-batch counts)
        mine = slice(0, 7) if t.rank == 0 else slice(7, 10)
        acc = StepAccumulator(t, ReinforceLoss(needs_entropy=True, entropy_coef=0.01), BUDGET, len(samples),
                              count_loss_tokens(samples))
        acc.add(samples[mine][:3], adv[mine][:3])
        acc.add(samples[mine][3:], adv[mine][3:])
        stats.append(acc.finish())
    weights = {n: w.clone() for n, w in t.named_weights()}
    for n, w in t.named_weights(torch.bfloat16):  # collective: each shard cast before the gather, the same values
        assert w.dtype == torch.bfloat16 and torch.equal(w, weights[n].to(torch.bfloat16)), n
    t.save(os.path.splitext(out)[0] + ".saved")  # collective; rank 0 writes the HF folder
    if lora:
        with torch.no_grad():
            for p in t.model.parameters():
                if p.requires_grad:
                    p.zero_()
        t.load_adapter(os.path.splitext(out)[0] + ".saved")
        for n, w in t.named_weights():
            assert torch.equal(w, weights[n]), n
        state = t.train_state()  # collective: the adapter's optimizer state, unsharded, keyed by name
        if t.rank == 0:
            keys = sorted(state["optimizer"]["state"])
            assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:3]
            assert len(keys) == len(weights)
            torch.save(state, os.path.splitext(out)[0] + ".train_state.pt")
        torch.distributed.barrier(group=t.cpu_group)
        t.load_train_state(torch.load(os.path.splitext(out)[0] + ".train_state.pt", weights_only=True))
        again = t.train_state()  # each rank took its shard back: gathered again, the same tensors
        if t.rank == 0:
            for k, s in state["optimizer"]["state"].items():
                for m in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(again["optimizer"]["state"][k][m], s[m]), (k, m)
    if t.rank == 0:
        torch.save({"weights": weights, "stats": stats, "version": t.version}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["lora"])
