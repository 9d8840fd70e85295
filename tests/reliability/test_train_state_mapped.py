"""FSDP2 resume: restore_trainer maps the checkpoint's train_state.pt (torch.load mmap=True) for a trainer that
loads rank 0's optimizer state only, so ranks > 0 never read those tensors into their own memory; a single-device
trainer reads it. Checked on the process's memory map (/proc/self/maps): a mapped tensor's storage lies in a region
backed by the file, a read one's does not. Fast: stand-ins of the trainers, no model, no process group."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.trainer.fsdp import FSDP2Trainer
from inflight.trainer.loop import checkpoint as ckpt
from inflight.trainer.single import SingleDeviceTrainer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def file_regions(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process mapped from `path`."""
    want, out = os.path.realpath(path), []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == want:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


def stand_in(base: type, tensors: dict[str, torch.Tensor]):
    """`base` as restore_trainer sees it (its class attributes: train_state_from_rank0), without a model: save and
    train_state write the given optimizer tensors, load_train_state keeps what it was passed."""

    class Policy(base):  # type: ignore[misc, valid-type]
        adapter = None  # full weights, no LoRA

        def __init__(self):
            super().__init__("unused", TrainerConfig())
            self.loaded: dict | None = None

        def save(self, folder: str) -> None:
            Path(folder).mkdir(parents=True, exist_ok=True)

        def train_state(self) -> dict:
            return {"optimizer": {"state": {n: {"exp_avg": t} for n, t in tensors.items()}}, "version": 2}

        def load_train_state(self, state: dict) -> None:
            self.loaded = state

    return Policy()


@pytest.mark.parametrize("base,mapped", [(FSDP2Trainer, True), (SingleDeviceTrainer, False)])
def test_ranks_map_the_optimizer_state_instead_of_reading_it(tmp_path, base, mapped):
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(3)}  # 1 MiB each
    writer = stand_in(base, tensors)
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", "step_000002", writer,
                                ckpt.CheckpointState(step=2, version=2, samples_trained=8, next_group=4))
    policy = stand_in(base, {})  # a rank that restores (rank 1 of an FSDP2 run: it holds no state of its own)
    rng = torch.get_rng_state()
    ckpt.restore_trainer(policy, path)
    torch.set_rng_state(rng)  # restore_trainer set the checkpoint's
    assert policy.loaded is not None and policy.version == 2
    got = policy.loaded["optimizer"]["state"]
    regions = file_regions(path / ckpt.TRAIN_STATE)
    assert bool(regions) == mapped, (base.__name__, regions)
    for n, t in tensors.items():
        loaded = got[n]["exp_avg"]
        assert torch.equal(loaded, t)
        ptr = loaded.untyped_storage().data_ptr()
        inside = any(lo <= ptr < hi for lo, hi in regions)
        assert inside == mapped, f"{base.__name__}: {n} is {'read into memory' if mapped else 'mapped'}, " \
                                 f"not {'mapped from' if mapped else 'read from'} {ckpt.TRAIN_STATE}"
