"""One rank of the FSDP2 resume test (a subprocess with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set).

usage: python fsdp_resume_worker.py MODEL_DIR RUN_DIR OUT_FILE
A: 2 steps, checkpoint (DistributedTrainerLoop.checkpoint, the pipeline's own path), 2 more steps.
B: a trainer built from the checkpoint folder and restored (restore_trainer), the same 2 steps.
C: the same, without the optimizer state (scheduler, RNG and version only): must end elsewhere.
Rank 0 saves the three final weight sets with torch.save.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from inflight.config import RunConfig  # noqa: E402
from inflight.config.trainer import TrainerConfig  # noqa: E402
from inflight.report.metrics import MetricsLogger  # noqa: E402
from inflight.trainer.accumulate import StepAccumulator  # noqa: E402
from inflight.trainer.fsdp import FSDP2Trainer  # noqa: E402
from inflight.trainer.loop.checkpoint import TRAIN_STATE, restore_trainer  # noqa: E402
from inflight.trainer.loop.fsdp_loop import DistributedTrainerLoop  # noqa: E402
from inflight.trainer.packing import count_loss_tokens  # noqa: E402
from tests.trainer.cpu_collectives import default_group_refuses_cpu_tensors  # noqa: E402
from tests.trainer.helpers import ReinforceLoss, random_samples  # noqa: E402

CFG = dict(lr=1e-2, max_grad_norm=1.0, threads=1, warmup_steps=1, schedule="cosine", total_steps=8)


def train_step(t: FSDP2Trainer, step: int) -> None:
    samples = random_samples(8, t.model.config.vocab_size, seed=200 + step)
    adv = [((i * 5 + step) % 7) / 3.0 - 1.0 for i in range(8)]
    mine = slice(0, 5) if t.rank == 0 else slice(5, 8)  # uneven shares on purpose
    acc = StepAccumulator(t, ReinforceLoss(), 64, len(samples), count_loss_tokens(samples))
    acc.add(samples[mine], adv[mine])
    acc.finish()


def final_weights(t: FSDP2Trainer) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in t.named_weights()}  # collective


def main(model_dir: str, run_dir: str, out: str) -> None:
    default_group_refuses_cpu_tensors()  # as NCCL would on CUDA: CPU collectives must take the trainer's cpu_group
    a = FSDP2Trainer(model_dir, TrainerConfig(backend="fsdp2", **CFG))
    a.init()
    rank = a.rank
    for step in range(2):
        train_step(a, step)
    loop = DistributedTrainerLoop(RunConfig(), a, None, None, MetricsLogger(run_dir, "trainer") if rank == 0 else None,
                                  run_dir, rank=rank, world_size=a.world_size)
    loop.checkpoint()
    path = Path(run_dir) / "checkpoints" / "step_000002"
    torch.distributed.barrier(group=a.cpu_group)
    for step in range(2, 4):
        train_step(a, step)
    wa = final_weights(a)

    b = FSDP2Trainer(str(path), TrainerConfig(backend="fsdp2", **CFG))
    b.init()
    state = restore_trainer(b, path)
    resumed = DistributedTrainerLoop(RunConfig(), b, None, None, None, run_dir, rank=rank, world_size=b.world_size,
                                     resume=state)
    for step in range(2, 4):
        train_step(b, step)
    wb = final_weights(b)

    c = FSDP2Trainer(str(path), TrainerConfig(backend="fsdp2", **CFG))
    c.init()
    extra = torch.load(path / TRAIN_STATE, weights_only=True)
    c.scheduler.load_state_dict(extra["scheduler"])
    c.version = extra["version"]
    for step in range(2, 4):
        train_step(c, step)
    wc = final_weights(c)
    if rank == 0:
        opt_keys = sorted(extra["optimizer"]["state"])
        torch.save({"a": wa, "b": wb, "c": wc, "versions": [a.version, b.version, c.version],
                    "opt_keys": opt_keys, "lr": [a.scheduler.get_last_lr()[0], b.scheduler.get_last_lr()[0]],
                    "resumed_step": resumed.resumed.step if resumed.resumed else None}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
