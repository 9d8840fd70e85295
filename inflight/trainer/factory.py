"""`make_trainer`: the training backend that `trainer.backend` names (FSDP2 imported only when chosen)."""

from __future__ import annotations

from dataclasses import replace

from inflight.config.trainer import TrainerConfig
from inflight.trainer.single import SingleDeviceTrainer


def make_trainer(model_path: str, cfg: TrainerConfig, frozen: bool = False) -> SingleDeviceTrainer:
    """The backend named by cfg.backend (not yet initialised: call init()); FSDP2Trainer is a SingleDeviceTrainer
    whose every step is collective. `frozen`: a model that only computes logprobs (make_reference)."""
    if cfg.backend == "single":
        return SingleDeviceTrainer(model_path, cfg, frozen)
    if cfg.backend == "fsdp2":
        from inflight.trainer.fsdp import FSDP2Trainer  # lazy: torch.distributed.checkpoint takes ~2 s to import

        return FSDP2Trainer(model_path, cfg, frozen)
    raise ValueError(f"trainer.backend must be 'single' or 'fsdp2', got {cfg.backend!r}")


def make_reference(model_path: str, cfg: TrainerConfig) -> SingleDeviceTrainer:
    """The frozen reference model of the KL term (algo.kl_coef > 0), initialised: the weights at `model_path`
    without an adapter (with trainer.lora, the base alone), on the policy's backend and precision: with fsdp2
    sharded over the same ranks like the policy (init and forward_logprobs are collective), no optimizer, no
    gradients, eval mode."""
    ref = make_trainer(model_path, replace(cfg, lora=None), frozen=True)
    ref.init()
    return ref
