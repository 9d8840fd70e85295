"""`make_trainer`: the training backend that `trainer.backend` names (each imported only when chosen)."""

from __future__ import annotations

from inflight.config.trainer import TrainerConfig
from inflight.contracts import TrainEngine


def make_trainer(model_path: str, cfg: TrainerConfig) -> TrainEngine:
    """The backend named by cfg.backend (not yet initialised: call init())."""
    if cfg.backend == "single":
        from inflight.trainer.single import SingleDeviceTrainer

        return SingleDeviceTrainer(model_path, cfg)
    if cfg.backend == "fsdp2":
        from inflight.trainer.fsdp import FSDP2Trainer

        return FSDP2Trainer(model_path, cfg)
    raise ValueError(f"trainer.backend must be 'single' or 'fsdp2', got {cfg.backend!r}")
