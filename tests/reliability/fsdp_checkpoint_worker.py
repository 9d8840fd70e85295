"""One rank of the FSDP2 resume-then-checkpoint test (a subprocess with RANK / WORLD_SIZE / MASTER_* set).

usage: python fsdp_checkpoint_worker.py MODEL_DIR RUN_DIR OUT_PREFIX
A: 1 step from MODEL_DIR, checkpoint step_000001 (DistributedTrainerLoop.checkpoint, the pipeline's path).
B: a trainer built from step_000001 and restored (restore_trainer), as a resumed run is. Each rank writes
   OUT_PREFIX.rank<r>.json: how much optimizer state it handed to set_optimizer_state_dict, whether the optimizer
   tensors it got lie in a mapping of the checkpoint's file and how many of their bytes were brought into memory,
   and how its optimizer shards compare with the checkpoint's full state. Then 3 steps, each checkpointed
   (keep_checkpoints 2: the second prunes step_000001, the folder B was built from); rank 0 saves B's final
   weights to OUT_PREFIX.pt.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint.state_dict as dcp_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from inflight.config import RunConfig  # noqa: E402
from inflight.config.trainer import TrainerConfig  # noqa: E402
from inflight.report.metrics import MetricsLogger  # noqa: E402
from inflight.trainer import fsdp as fsdp_module  # noqa: E402
from inflight.trainer.accumulate import StepAccumulator  # noqa: E402
from inflight.trainer.fsdp import FSDP2Trainer  # noqa: E402
from inflight.trainer.loop.checkpoint import TRAIN_STATE, restore_trainer  # noqa: E402
from inflight.trainer.loop.fsdp_loop import DistributedTrainerLoop  # noqa: E402
from inflight.trainer.packing import count_loss_tokens  # noqa: E402
from tests.trainer.cpu_collectives import default_group_refuses_cpu_tensors  # noqa: E402
from tests.trainer.helpers import ReinforceLoss, random_samples  # noqa: E402

CFG = dict(lr=1e-2, max_grad_norm=1.0, threads=1, warmup_steps=0, schedule="constant")


def train_step(t: FSDP2Trainer, step: int) -> None:
    samples = random_samples(4, t.model.config.vocab_size, seed=300 + step)
    adv = [1.0, -1.0, 0.5, -0.5]
    mine = slice(0, 2) if t.rank == 0 else slice(2, 4)
    acc = StepAccumulator(t, ReinforceLoss(), 64, len(samples), count_loss_tokens(samples))
    acc.add(samples[mine], adv[mine])
    acc.finish()


def loop_of(t: FSDP2Trainer, run_dir: str) -> DistributedTrainerLoop:
    log = MetricsLogger(run_dir, "trainer") if t.rank == 0 else None
    return DistributedTrainerLoop(RunConfig(), t, None, None, log, run_dir, rank=t.rank, world_size=t.world_size)


def shards_vs_checkpoint(t: FSDP2Trainer, full: dict) -> dict:
    """Each optimizer state tensor of this rank against its rows of the checkpoint's full tensor (FSDP2 shards
    dim 0 as torch.chunk does)."""
    names = {p: n for n, p in t.model.named_parameters()}
    compared, diff = 0, 0.0
    for p, st in t.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            local = st[key].to_local()
            chunks = full[names[p]][key].chunk(t.world_size, dim=0)
            want = chunks[t.rank] if t.rank < len(chunks) else full[names[p]][key][:0]
            assert local.shape == want.shape, (names[p], key, local.shape, want.shape)
            diff = max(diff, float((local - want).abs().max()) if local.numel() else 0.0)
            compared += 1
        assert float(st["step"]) == float(full[names[p]]["step"])
    return {"compared": compared, "max_diff": diff, "params": len(names)}


def file_mappings(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each mapping of `path` in this process (/proc/self/smaps)."""
    out, target, current = [], str(path.resolve()), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if not head[0].endswith(":"):  # a mapping's first line: start-end perms offset dev inode [path]
            current = None
            if " ".join(head[5:]) == target:
                start, end = (int(x, 16) for x in head[0].split("-"))
                current = [start, end, 0]
                out.append(current)
        elif head[0] == "Rss:" and current is not None:
            current[2] = int(head[1]) * 1024
    return [(a, b, r) for a, b, r in out]


def spy_on_mapping(t: FSDP2Trainer, path: Path, seen: dict) -> None:
    """Wraps t.load_train_state: where the optimizer tensors it is handed live, and how much of the file's mapping
    is resident once it has run (pages are brought in only when read)."""
    real = t.load_train_state

    def load(state: dict) -> None:
        tensors = [x for st in state["optimizer"]["state"].values() for k, x in st.items() if k != "step"]
        maps = file_mappings(path)
        seen["mapped"] = all(any(a <= x.data_ptr() < b for a, b, _ in maps) for x in tensors)
        seen["optimizer_bytes"] = sum(x.nbytes for x in tensors)
        real(state)
        seen["resident"] = sum(r for _, _, r in file_mappings(path))

    t.load_train_state = load


def main(model_dir: str, run_dir: str, out: str) -> None:
    default_group_refuses_cpu_tensors()
    handed = []  # entries of the optimizer state each call passed in (the real function still runs)
    real = dcp_state_dict.set_optimizer_state_dict
    spy = lambda m, o, osd, **k: handed.append(len(osd.get("state", {}))) or real(m, o, osd, **k)  # noqa: E731
    for module in (fsdp_module, dcp_state_dict):  # the name the trainer calls, whichever module it takes it from
        if hasattr(module, "set_optimizer_state_dict"):
            module.set_optimizer_state_dict = spy

    a = FSDP2Trainer(model_dir, TrainerConfig(backend="fsdp2", **CFG))
    a.init()
    train_step(a, 0)
    loop_of(a, run_dir).checkpoint()
    path = Path(run_dir) / "checkpoints" / "step_000001"
    torch.distributed.barrier(group=a.cpu_group)

    b = FSDP2Trainer(str(path), TrainerConfig(backend="fsdp2", **CFG))
    b.init()
    mapping: dict = {}
    spy_on_mapping(b, path / TRAIN_STATE, mapping)
    restore_trainer(b, path)
    full = torch.load(path / TRAIN_STATE, weights_only=True)["optimizer"]["state"]
    report = {"handed": handed, **mapping, **shards_vs_checkpoint(b, full)}
    Path(f"{out}.rank{b.rank}.json").write_text(json.dumps(report))
    loop = loop_of(b, run_dir)
    for step in range(1, 4):
        train_step(b, step)
        loop.checkpoint()
    weights = {n: w.clone() for n, w in b.named_weights()}
    if b.rank == 0:
        torch.save(weights, f"{out}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
