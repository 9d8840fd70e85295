"""The value model of PPO with a critic (`algo.advantage: gae`, `critic:`), on the single-device trainer (FSDP2: the
subclass in critic_fsdp.py, whose `_rounds` / `_total` make values and train collective over the ranks).

    critic = Critic(cfg.critic.model_path or cfg.model.path, cfg.trainer, cfg.critic)
    critic.init()
    values = critic.values(samples)                    # V(s_t) per completion token, the current weights, no grad
    stats = critic.train(samples, values, returns)     # clipped value loss, critic.mini_batches optimizer steps
    critic.save(folder); critic.load(folder)           # weights + optimizer + scheduler, exactly

The model is the causal LM at `model_path` with its output embedding replaced by a scalar head (a linear layer
[hidden -> 1] with a bias, both 0 at the start, so every first value is 0): the packed forward, shared prompts,
fused CPU kernels, gradient checkpointing and LoRA of the policy's trainer (logprobs.py, single.py) run it as they
run the policy, and its "logits" [T, 1] are the values. V(s_t) of completion token t is the output at the token
before t (the state that token was sampled in), as the policy's logprob of t is predicted there. With trainer.lora
the critic trains an adapter of its own (same rank, alpha and targets) on its own copy of the base, plus the head in
full (on FSDP2 too: critic_fsdp.py, whose rank 0 reads the weights with load_critic as init does here, so the
adapter's init draws the same numbers); without, the whole critic. Its optimizer is AdamW at critic.lr (0:
trainer.lr) with critic.weight_decay and the trainer's betas, schedule (stepped once per trainer step) and
max_grad_norm.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from inflight.algo.gae import clipped_value_loss
from inflight.config.critic import CriticConfig
from inflight.config.trainer import TrainerConfig
from inflight.contracts import Sample, TrainBatch
from inflight.trainer.accumulate import empty_batch
from inflight.trainer.kernels.fused import fuse_modules
from inflight.trainer.logprobs import packed_logits
from inflight.trainer.optim import build_optimizer
from inflight.trainer.packing import collate, completion_slices, count_loss_tokens, first_fit_decreasing
from inflight.trainer.single import attn_implementation, autocast, for_training

WEIGHTS = "critic.safetensors"  # the trained tensors by parameter name (LoRA: the adapter and the head)
TRAIN_STATE = "train_state.pt"  # optimizer and scheduler (torch.load(weights_only=True) reads it)


def critic_trainer_config(trainer: TrainerConfig, critic: CriticConfig) -> TrainerConfig:
    """The trainer's settings with the critic's lr and weight decay; no chunked head (the head is not a vocabulary)."""
    return replace(trainer, lr=critic.lr or trainer.lr, weight_decay=critic.weight_decay, chunked_head=False)


def spread(samples: Sequence[Sample], rows: Sequence[Sequence[float]]) -> torch.Tensor:
    """Per-completion-token values laid out like collate's batch of these samples (0 on prompt tokens)."""
    out: list[float] = []
    for s, row in zip(samples, rows, strict=True):
        if len(row) != len(s.completion_ids):
            raise ValueError(f"{len(s.completion_ids)} completion tokens but {len(row)} values")
        out += [0.0] * len(s.prompt_ids) + [float(x) for x in row]
    return torch.tensor(out, dtype=torch.float32)


def add_value_head(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with its output embedding replaced by the value head [hidden -> 1] (zeros; on the meta device when
    the model is there), in the model's dtype."""
    p = next(model.parameters())
    head = torch.nn.Linear(model.config.hidden_size, 1, bias=True, dtype=p.dtype, device=p.device)
    if p.device.type != "meta":
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    model.config.tie_word_embeddings = False  # the head is no longer the input embedding's transpose
    model.set_output_embeddings(head)
    return model


def load_critic(model_path: str, tcfg: TrainerConfig, device: torch.device | str) -> PreTrainedModel:
    """The causal LM at `model_path` as the critic, on `device`: the value head in place of the output embedding,
    then for_training (trainer.lora: the adapter, the base frozen), the head trainable in full. The order fixes what
    a LoRA adapter's init draws from the RNG (the head's Linear draws first), on the single trainer and on FSDP2's
    rank 0 alike."""
    model: PreTrainedModel = add_value_head(AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=attn_implementation(tcfg)))
    head = model.get_output_embeddings()
    model.to(device)  # type: ignore[arg-type]  # in place (see single.load_model)
    model = for_training(model, tcfg, model_path)
    head.requires_grad_(True)  # with LoRA only the adapter was left trainable: the head trains in full
    return model


class Critic:
    """Attributes: model (the HF model with the value head), optimizer, scheduler, steps (trainer steps trained)."""

    share_prompts = True

    def __init__(self, model_path: str, trainer: TrainerConfig, cfg: CriticConfig):
        self.model_path = str(model_path)
        self.cfg = cfg
        self.tcfg = critic_trainer_config(trainer, cfg)
        self.device = torch.device(self.tcfg.device)
        self.model: PreTrainedModel | None = None
        self.steps = 0

    def init(self) -> None:
        model = load_critic(self.model_path, self.tcfg, self.device)
        if self.device.type == "cpu":
            fuse_modules(model)
        self.model = model
        self.optimizer, self.scheduler = build_optimizer(model.parameters(), self.tcfg)

    def _require_init(self) -> PreTrainedModel:
        if self.model is None:
            raise RuntimeError("call init() first")
        return self.model

    def _values(self, batch: TrainBatch) -> torch.Tensor:
        """[T] float32: V of token t's state = the head at token t − 1; 0 on each sample's first token."""
        model = self._require_init()
        with autocast(self.tcfg, self.device):
            out = packed_logits(model, batch, self.device, self.share_prompts)[:, 0].float()
        shifted = torch.cat([out.new_zeros(1), out[:-1]])
        first = batch.position_ids.to(out.device) == 0
        return torch.where(first, torch.zeros_like(shifted), shifted)

    def _rounds(self, n: int) -> int:
        """How many forwards (or backwards) every rank runs when this one has `n` (FSDP2: the most of any rank)."""
        return n

    def _total(self, values: list[float]) -> list[float]:
        """`values` summed element-wise over the ranks (FSDP2); here: as they are."""
        return list(values)

    @torch.no_grad()
    def values(self, samples: Sequence[Sample]) -> list[list[float]]:
        """V(s_t) of every completion token of every sample under the current weights (one list per sample).
        Collective with FSDP2 (a rank with fewer micro-batches runs stand-ins)."""
        model = self._require_init()
        model.eval()
        out: list[list[float]] = [[] for _ in samples]
        bins = first_fit_decreasing([len(s) for s in samples], self.tcfg.micro_batch_tokens) if samples else []
        for k in range(self._rounds(len(bins))):
            if k >= len(bins):
                self._values(empty_batch(1, 1))  # this rank is done; the others' forwards need it
                continue
            part = [samples[j] for j in bins[k]]
            v = self._values(collate(part, [0.0] * len(part), 1, 1, with_versions=False)).double().cpu().tolist()
            for j, (lo, hi) in zip(bins[k], completion_slices(part), strict=True):
                out[j] = v[lo:hi]
        return out

    def train(self, samples: Sequence[Sample], old_values: Sequence[Sequence[float]],
              returns: Sequence[Sequence[float]], index: Sequence[int] | None = None,
              n_step: int | None = None) -> dict[str, float]:
        """critic.mini_batches optimizer steps on consecutive slices of the step's samples, each minimising the mean
        over its trained tokens of the clipped value loss (algo/gae.py) around `old_values`; then one scheduler step.
        With FSDP2 each rank passes its share, `index` (each sample's position among the step's `n_step`): the
        slices and their token counts are the whole step's, so N ranks take the single trainer's steps."""
        model = self._require_init()
        model.train()
        n = len(samples) if n_step is None else n_step
        pos = list(range(len(samples))) if index is None else list(index)
        k = max(1, min(self.cfg.mini_batches, n))
        loss_sum, tokens, clipped, norms = 0.0, 0.0, 0.0, []
        lr = self.scheduler.get_last_lr()[0]
        for i in range(k):
            part_idx = [j for j, p in enumerate(pos) if i * n // k <= p < (i + 1) * n // k]
            part = [samples[j] for j in part_idx]
            (n_tok,) = self._total([float(count_loss_tokens(part))])  # the slice's tokens on every rank
            bins = first_fit_decreasing([len(s) for s in part], self.tcfg.micro_batch_tokens) if part else []
            for r in range(self._rounds(len(bins))):
                if r >= len(bins):  # a stand-in: no gradient, but the others' backward collectives need it
                    (self._values(empty_batch(1, 1)).sum() * 0.0).backward()
                    continue
                mb = [part[j] for j in bins[r]]
                rows: list[float | list[float]] = [list(returns[part_idx[j]]) for j in bins[r]]
                batch = collate(mb, rows, 1, 1, with_versions=False)
                old = spread(mb, [old_values[part_idx[j]] for j in bins[r]]).to(self.device)
                ret, m = batch.advantages.to(self.device), batch.loss_mask.to(self.device) > 0
                per_token, clip = clipped_value_loss(self._values(batch), old, ret, self.cfg.value_clip)
                per_token = torch.where(m, per_token, torch.zeros_like(per_token))
                (per_token.sum() / max(n_tok, 1.0)).backward()
                loss_sum += float(per_token.detach().double().sum())
                clipped += float((clip & m).sum())
            tokens += n_tok
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.tcfg.max_grad_norm)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))  # sharded (FSDP2)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.steps += 1
        loss_sum, clipped = self._total([loss_sum, clipped])
        return {"value_loss": loss_sum / max(tokens, 1.0), "value_clip_frac": clipped / max(tokens, 1.0),
                "critic_grad_norm": sum(norms) / len(norms), "critic_lr": float(lr)}

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self._require_init().named_parameters() if p.requires_grad}

    def save(self, out_dir: str | Path) -> None:
        """critic.safetensors (the trained tensors) and train_state.pt (optimizer, scheduler, steps) in `out_dir`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().cpu().contiguous() for n, p in self.trained_tensors().items()}, str(out / WEIGHTS),
                  metadata={"format": "pt"})
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "steps": self.steps}, out / TRAIN_STATE)

    def load(self, folder: str | Path) -> None:
        """What `save` wrote, into this critic (built from the same model path and settings), exactly."""
        folder = Path(folder)
        state = load_file(str(folder / WEIGHTS))
        mine = self.trained_tensors()
        shapes = {n: tuple(p.shape) for n, p in mine.items()}
        if shapes != {n: tuple(t.shape) for n, t in state.items()}:
            raise ValueError(f"the critic in {folder} does not fit this critic (its tensors: {len(state)}, here: "
                             f"{len(mine)}): resume with the run's model, critic.model_path and trainer.lora")
        with torch.no_grad():
            for name, p in mine.items():
                p.copy_(state[name])
        extra = torch.load(folder / TRAIN_STATE, map_location="cpu", weights_only=True)
        if extra.get("backend", "single") != "single":
            raise ValueError(f"the critic in {folder} was trained with trainer.backend={extra['backend']}: resume it "
                             "with that backend")
        self.optimizer.load_state_dict(extra["optimizer"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self.steps = int(extra["steps"])
