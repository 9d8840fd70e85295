"""AdamW with linear warm-up then constant or cosine learning rate (shared by the training backends)."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from inflight.config.trainer import TrainerConfig


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warm-up over warmup_steps, then 1
    (constant) or a cosine decay to 0 at total_steps."""
    if cfg.schedule not in ("constant", "cosine"):
        raise ValueError(f"trainer.schedule must be 'constant' or 'cosine', got {cfg.schedule!r}")
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def fused_supported(device_types: set[str], all_float: bool, sharded: bool) -> bool:
    """Whether torch's fused AdamW kernel runs on parameters of these device types: one pass per tensor instead of
    ~10 ops (tiny demo model on one CPU thread: 0.6 ms per step against 4.2 ms). On CUDA for plain and FSDP2's
    sharded (DTensor) floating-point parameters alike; on CPU for plain tensors only (the sharded CPU runs keep the
    default implementation)."""
    if not device_types or not all_float:
        return False
    if device_types == {"cuda"}:
        return True
    return device_types == {"cpu"} and not sharded


def use_fused(params: Sequence[torch.Tensor]) -> bool:
    return fused_supported({p.device.type for p in params}, all(p.is_floating_point() for p in params),
                           any(type(p) is not torch.nn.Parameter for p in params))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: TrainerConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    betas = tuple(float(b) for b in cfg.betas)
    trained = [p for p in params if p.requires_grad]
    fused = cfg.fused_optimizer and use_fused(trained)
    opt = torch.optim.AdamW(trained, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay,  # type: ignore[arg-type]
                            fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return opt, sched
