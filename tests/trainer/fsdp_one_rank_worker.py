"""The FSDP2 backend at one rank (a subprocess with RANK=0 / WORLD_SIZE=1 / MASTER_ADDR / MASTER_PORT set).

usage: python fsdp_one_rank_worker.py MODEL_DIR OUT_FILE [shard]
One optimizer step on all samples of step 0 (fsdp_worker.step_samples); saves the weights, the step's stats and
whether the model was sharded (an FSDPModule) with torch.save. `shard`: trainer.fsdp_shard_one_rank=true.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torch.distributed.fsdp import FSDPModule  # noqa: E402

from inflight.config.trainer import TrainerConfig  # noqa: E402
from inflight.trainer.accumulate import StepAccumulator  # noqa: E402
from inflight.trainer.fsdp import FSDP2Trainer  # noqa: E402
from inflight.trainer.packing import count_loss_tokens  # noqa: E402
from tests.trainer.fsdp_worker import BUDGET, CFG, step_samples  # noqa: E402
from tests.trainer.helpers import ReinforceLoss  # noqa: E402


def main(model_dir: str, out: str, shard: bool) -> None:
    t = FSDP2Trainer(model_dir, TrainerConfig(backend="fsdp2", fsdp_shard_one_rank=shard, **CFG))
    t.init()
    assert t.world_size == 1
    samples, adv = step_samples(0, t.model.config.vocab_size)
    acc = StepAccumulator(t, ReinforceLoss(needs_entropy=True, entropy_coef=0.01), BUDGET, len(samples),
                          count_loss_tokens(samples))
    acc.add(samples, adv)
    stats = acc.finish()
    state = t.train_state()  # collective methods work on the plain module too
    assert state["backend"] == "fsdp2" and len(state["optimizer"]["state"]) == len(list(t.model.parameters()))
    torch.save({"weights": {n: w.clone() for n, w in t.named_weights()}, "stats": stats,
                "sharded": isinstance(t.model, FSDPModule)}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "shard")
