"""`make_trainer`: the training backend that `trainer.backend` names (FSDP2 imported only when chosen)."""

from __future__ import annotations

from inflight.config.trainer import TrainerConfig
from inflight.trainer.single import SingleDeviceTrainer


def make_trainer(model_path: str, cfg: TrainerConfig) -> SingleDeviceTrainer:
    """The backend named by cfg.backend (not yet initialised: call init()); FSDP2Trainer is a SingleDeviceTrainer
    whose every step is collective."""
    if cfg.backend == "single":
        return SingleDeviceTrainer(model_path, cfg)
    if cfg.backend == "fsdp2":
        from inflight.trainer.fsdp import FSDP2Trainer  # lazy: torch.distributed.checkpoint takes ~2 s to import

        return FSDP2Trainer(model_path, cfg)
    raise ValueError(f"trainer.backend must be 'single' or 'fsdp2', got {cfg.backend!r}")
