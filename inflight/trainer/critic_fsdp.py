"""The value model of PPO with a critic on the FSDP2 trainer: trainer/critic.py's Critic, sharded like the policy.

    critic = FSDP2Critic(cfg.critic.model_path or cfg.model.path, cfg.trainer, cfg.critic)
    critic.init()                                       # collective: every rank builds its shard
    values = critic.values(my_samples)                  # collective (stand-in forwards for a rank short of work)
    stats = critic.train(my_samples, values, returns, index, n_step)   # collective; stats of the whole step
    critic.save(folder); critic.load(folder)            # collective; rank 0 writes

The model is built as FSDP2Trainer builds the policy (rank 0 reads model_path, every rank shards a meta copy with
the same fully_shard calls and gets rank 0's values), with the value head in place of the output embedding, and its
own AdamW over its shards. With trainer.lora the build is the LoRA policy's: its own adapter on the base (frozen),
sharded by the same calls, with the value head trained in full. Gradients are summed over the ranks (divide factor
1) and the value loss divides by the token count of the whole mini-batch, so N ranks take the single trainer's
optimizer steps. The checkpoint holds the trained tensors whole (gathered) and the optimizer state keyed by
parameter name, as the policy's train_state does: it loads on any number of ranks, not into the single trainer
(whose optimizer state is keyed by position); with trainer.lora only the adapter and the head are saved (the base
comes from the model path), as on the single trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from transformers import PreTrainedModel

from inflight.config.critic import CriticConfig
from inflight.config.trainer import TrainerConfig
from inflight.trainer.critic import TRAIN_STATE, WEIGHTS, Critic, add_value_head, load_critic
from inflight.trainer.fsdp import FSDP2Trainer
from inflight.trainer.optim import build_optimizer
from inflight.trainer.weight_sync.gather import gathered

BACKEND = "fsdp2"


class _CriticShards(FSDP2Trainer):
    """FSDP2Trainer's build of the critic's model (the policy's causal LM with the value head); no tokenizer, no
    save skeleton: only the sharded model and its optimizer."""

    def _source_model(self, device: torch.device | str) -> PreTrainedModel:
        return load_critic(self.model_path, self.cfg, device)  # as the single trainer's critic reads it

    def _meta_model(self) -> PreTrainedModel:
        """The policy's meta model (with trainer.lora its adapter) with the value head, trainable; no storage: the
        values come from rank 0's source (load_critic)."""
        return add_value_head(super()._meta_model())

    def _finish_init(self) -> None:
        assert self.model is not None
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), self.cfg)


class FSDP2Critic(Critic):
    """Critic over all ranks of the default process group; every method is collective. Attributes: Critic's, and
    rank, world_size, cpu_group (gloo, for the CPU sums)."""

    def __init__(self, model_path: str, trainer: TrainerConfig, cfg: CriticConfig):
        super().__init__(model_path, trainer, cfg)
        self.rank, self.world_size = 0, 1
        self.cpu_group: Any = None

    def init(self) -> None:
        shards = _CriticShards(self.model_path, self.tcfg)
        shards.init()
        self.model, self.device = shards.model, shards.device
        self.optimizer, self.scheduler = shards.optimizer, shards.scheduler
        self.rank, self.world_size, self.cpu_group = shards.rank, shards.world_size, shards.cpu_group

    def _rounds(self, n: int) -> int:
        if self.world_size <= 1:
            return n
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return int(t)

    def _total(self, values: list[float]) -> list[float]:
        if self.world_size <= 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.cpu_group)
        return t.tolist()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the trained tensors whole (gathered one at a time: a LoRA critic's frozen base never is), on
        the host (rank 0; the other ranks get an empty dict)."""
        out = {}
        for name, p in self.trained_tensors().items():
            t = gathered(p).cpu()
            if self.rank == 0:
                out[name] = t
        return out

    def save(self, out_dir: str | Path) -> None:
        """Collective; rank 0 writes critic.safetensors (gathered) and train_state.pt (the optimizer state unsharded,
        keyed by parameter name; the scheduler; steps)."""
        model = self._require_init()
        weights = self.full_state()
        osd = get_optimizer_state_dict(model, self.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            save_file({n: t.contiguous() for n, t in weights.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
            torch.save({"optimizer": osd, "scheduler": self.scheduler.state_dict(), "steps": self.steps,
                        "backend": BACKEND}, out / TRAIN_STATE)
        dist.barrier(group=self.cpu_group)

    def load(self, folder: str | Path) -> None:
        """Collective: every rank reads what `save` wrote and keeps its shard; the optimizer state goes from rank 0
        to the others tensor by tensor."""
        model = self._require_init()
        folder = Path(folder)
        state = load_file(str(folder / WEIGHTS))
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}  # whole shapes
        if shapes != {n: tuple(t.shape) for n, t in state.items()}:
            raise ValueError(f"the critic in {folder} does not fit this critic (its tensors: {len(state)}, here: "
                             f"{len(shapes)}): resume with the run's model, critic.model_path and trainer.lora")
        extra = torch.load(folder / TRAIN_STATE, map_location="cpu", weights_only=True, mmap=True)
        if extra.get("backend") != BACKEND:
            raise ValueError(f"the critic in {folder} was trained with trainer.backend="
                             f"{extra.get('backend', 'single')}: resume it with that backend")
        set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True, strict=False))
        set_optimizer_state_dict(model, self.optimizer, extra["optimizer"] if self.rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        self.scheduler.load_state_dict(extra["scheduler"])
        self.steps = int(extra["steps"])


def make_critic(model_path: str, trainer: TrainerConfig, cfg: CriticConfig) -> Critic:
    """The critic for trainer.backend (fsdp2: sharded; build it on every rank)."""
    cls = FSDP2Critic if trainer.backend == BACKEND else Critic
    return cls(model_path, trainer, cfg)
