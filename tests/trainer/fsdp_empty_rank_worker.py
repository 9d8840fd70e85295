"""One rank of the empty-rank FSDP2 test (a subprocess with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set).

usage: python fsdp_empty_rank_worker.py MODEL_DIR OUT_FILE
One step as DistributedTrainerLoop takes it (StepAccumulator with the step's token count unknown until the end):
rank 0 trains all the step's samples, rank 1 has none (its samples all masked, or fewer groups than ranks). Rank 0
saves the step's stats and the weights after it with torch.save.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from inflight.config.trainer import TrainerConfig  # noqa: E402
from inflight.trainer.accumulate import StepAccumulator  # noqa: E402
from inflight.trainer.fsdp import FSDP2Trainer  # noqa: E402
from tests.trainer.cpu_collectives import default_group_refuses_cpu_tensors  # noqa: E402
from tests.trainer.helpers import ReinforceLoss, random_samples  # noqa: E402

CFG = dict(lr=1e-2, max_grad_norm=1e9, threads=1, warmup_steps=0, schedule="constant")
BUDGET = 48


def step_samples(vocab: int):
    samples = random_samples(6, vocab, seed=7)
    return samples, [(i % 3) - 1.0 + 0.25 for i in range(6)]


def main(model_dir: str, out: str) -> None:
    default_group_refuses_cpu_tensors()
    t = FSDP2Trainer(model_dir, TrainerConfig(backend="fsdp2", **CFG))
    t.init()
    samples, adv = step_samples(t.model.config.vocab_size)
    mine = slice(0, 6) if t.rank == 0 else slice(0, 0)
    acc = StepAccumulator(t, ReinforceLoss(), BUDGET, len(samples), None)
    acc.add(samples[mine], adv[mine])
    stats = acc.finish()
    weights = {n: w.clone() for n, w in t.named_weights()}
    if t.rank == 0:
        torch.save({"weights": weights, "stats": stats}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
