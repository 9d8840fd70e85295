"""Single-process training backend (CPU or one GPU), implementing contracts.TrainEngine.

    trainer = SingleDeviceTrainer("runs/models/tiny", TrainerConfig(lr=1e-4))
    trainer.init()
    for mb in pack_samples(samples, advantages, cfg.micro_batch_tokens, len(samples), n_tokens):
        trainer.backward(mb, loss_fn)           # gradients accumulate over micro-batches
    trainer.optimizer_step()                    # clip, step, zero, version += 1
    for name, tensor in trainer.named_weights(): ...   # broadcast to the inference servers
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from inflight.config.trainer import TrainerConfig
from inflight.contracts import LossFn, TrainBatch
from inflight.trainer.kernels.attention import NAME as PACKED
from inflight.trainer.kernels.fused import fuse_modules
from inflight.trainer.weight_sync.gather import gathered
from inflight.trainer.head import install as install_head
from inflight.trainer.logprobs import packed_token_logprobs
from inflight.trainer.lora import (adapter_spec, adapter_tensors, add_adapter, check_adapter_fits, check_lora,
                                   is_lora, read_adapter, save_adapter)
from inflight.trainer.memory import decide as decide_checkpointing
from inflight.trainer.memory import parse_choice
from inflight.trainer.optim import build_optimizer
from inflight.trainer.kernels.varlen import NAME as VARLEN
from inflight.trainer.kernels.varlen import available as varlen_available


def attn_implementation(cfg: TrainerConfig) -> str:
    """cfg.attention, or for "auto": on GPU in half precision one variable-length call per layer, torch's own
    varlen kernel ("inflight_varlen", varlen.py; shares prompts like the packed path) where this torch has it, else
    flash-attn's when installed; otherwise per-sample SDPA over the packed row ("inflight_packed", attention.py)."""
    if cfg.attention != "auto":
        return cfg.attention
    if cfg.device.startswith("cuda") and cfg.precision == "bf16-mixed":
        if varlen_available("cuda"):
            return VARLEN
        try:
            import flash_attn  # lazy: optional dependency, probed only on a GPU  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return PACKED


ATTENTIONS = ("auto", PACKED, VARLEN, "sdpa", "eager", "flash_attention_2")


def check_config(cfg: TrainerConfig) -> None:
    if cfg.precision not in ("float32", "bf16-mixed"):
        raise ValueError(f"trainer.precision must be 'float32' or 'bf16-mixed', got {cfg.precision!r}")
    if cfg.attention not in ATTENTIONS:
        raise ValueError(f"trainer.attention must be one of {ATTENTIONS}, got {cfg.attention!r}")
    parse_choice(cfg.gradient_checkpointing)
    if cfg.micro_batch_tokens <= 0:
        raise ValueError(f"trainer.micro_batch_tokens must be positive, got {cfg.micro_batch_tokens}")
    if cfg.lora is not None:
        check_lora(cfg.lora)


def load_model(model_path: str, cfg: TrainerConfig, device: torch.device | str = "cpu") -> PreTrainedModel:
    """Any HF causal LM by path, float32 master weights (bf16-mixed autocasts the compute); with trainer.lora,
    a fresh adapter on it (lora.py)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation=attn_implementation(cfg))
    model.to(device)  # type: ignore[arg-type]  # in place; transformers' wraps() on .to hides the bound self
    return for_training(model, cfg, model_path)


def for_training(model: PreTrainedModel, cfg: TrainerConfig, model_path: str | None = None,
                 device: torch.device | str | None = None, world_size: int = 1) -> PreTrainedModel:
    """No KV cache; the chunked head; gradient checkpointing when configured (auto: when the step would not fit
    `device`, default: the model's, memory.py); the LoRA adapter when configured."""
    model.config.use_cache = False
    if cfg.lora is not None:
        model = add_adapter(model, cfg.lora, model_path)
    if cfg.chunked_head:
        install_head(model)  # logprobs from the hidden states a chunk at a time (head.py); else the full logits
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if decide_checkpointing(model, cfg, device, world_size):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def freeze(model: torch.nn.Module) -> None:
    """A reference model: no parameter asks for a gradient, and eval mode (no dropout)."""
    model.requires_grad_(False)
    model.eval()


def autocast(cfg: TrainerConfig, device: torch.device | str) -> contextlib.AbstractContextManager:
    if cfg.precision == "bf16-mixed":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_loss(logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: TrainBatch, loss_fn: LossFn) -> tuple[
    torch.Tensor, dict[str, float]
]:
    """loss_fn on device tensors; the `0 * sum` term keeps every parameter in the graph (an all-masked batch then
    still yields zero gradients, which FSDP's collective backward relies on)."""
    loss, stats = loss_fn(logprobs, batch, entropy)
    loss = loss + 0.0 * logprobs.sum()
    stats = dict(stats)
    stats.setdefault("loss", float(loss.detach()))
    stats["batch_tokens"] = float(batch.num_tokens)  # packed tokens, prompts included ("tokens" is the loss's)
    return loss, stats


def batch_to(batch: TrainBatch, device: torch.device | str) -> TrainBatch:
    """A copy of the batch with its tensors on `device` (the loss function sees device tensors)."""
    fields: dict[str, Any] = {}
    for name, value in vars(batch).items():
        fields[name] = value.to(device) if isinstance(value, torch.Tensor) else value
    return TrainBatch(**fields)


class SingleDeviceTrainer:
    """TrainEngine on one device. Attributes: model, tokenizer, version (optimizer steps taken)."""

    world_size = 1
    rank = 0
    share_prompts = True  # samples with one prompt run it once per micro-batch (prefix.py; same gradients)

    def __init__(self, model_path: str, cfg: TrainerConfig, frozen: bool = False):
        check_config(cfg)
        self.model_path = str(model_path)
        self.cfg = cfg
        self.frozen = frozen  # a reference model: forward_logprobs only (no optimizer, no gradients, eval mode)
        self.device = torch.device(cfg.device)
        self.version = 0
        self.model: PreTrainedModel | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None

    def init(self) -> None:
        if self.cfg.threads > 0:
            torch.set_num_threads(self.cfg.threads)
        self.model = load_model(self.model_path, self.cfg, self.device)
        if self.device.type == "cpu":
            fuse_modules(self.model)  # RMSNorm and SwiGLU in one C pass each (fused.py)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.frozen:
            freeze(self.model)
        else:
            self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), self.cfg)

    def _require_init(self) -> PreTrainedModel:
        if self.model is None:
            raise RuntimeError("call init() first")
        return self.model

    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        model = self._require_init()
        was_training = model.training
        model.eval()
        try:
            with autocast(self.cfg, self.device):
                lp, _ = packed_token_logprobs(model, batch, self.device, self.share_prompts)
        finally:
            model.train(was_training)
        return lp.cpu()

    def _require_trainable(self) -> PreTrainedModel:
        if self.frozen:
            raise RuntimeError("a frozen (reference) model does not train")
        return self._require_init()

    def backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        model = self._require_trainable()
        model.train()  # gradient checkpointing only acts in training mode (RL models should have no dropout)
        need_entropy = bool(getattr(loss_fn, "needs_entropy", False))
        with autocast(self.cfg, self.device):
            lp, ent = packed_token_logprobs(model, batch, self.device, self.share_prompts, need_entropy,
                                            trained_only=True)
        loss, stats = run_loss(lp, ent, batch_to(batch, self.device), loss_fn)
        loss.backward()
        return stats

    def optimizer_step(self) -> dict[str, float]:
        model = self._require_trainable()
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # sharded (FSDP2)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": float(grad_norm), "lr": float(lr)}

    @property
    def adapter(self) -> dict[str, float] | None:
        """With trainer.lora: the update's `adapter` {rank, scaling} (named_weights yields the adapter only)."""
        model = self._require_init()
        return adapter_spec(model) if is_lora(model) else None

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every parameter, detached, in the model's dtype. Names are `named_parameters()`'s:
        a tied tensor (lm_head.weight of a tie_word_embeddings model) comes once, under its canonical name, as the
        weight-update contract wants (`state_dict()` would list the alias too). A sharded tensor is gathered one
        parameter at a time (collective); with `dtype` (the servers' dtype) each shard is cast before the gather,
        so the full tensor exists only in that dtype (an unsharded one is yielded as it is: the sender converts).
        With trainer.lora: the adapter's `<base>.lora_A` / `<base>.lora_B` only (lora.adapter_tensors), to be
        pushed with `adapter`."""
        model = self._require_init()
        if is_lora(model):
            yield from adapter_tensors(model, dtype)
            return
        for name, tensor in model.named_parameters():
            yield name, gathered(tensor, dtype)

    def train_state(self) -> dict:
        """Optimizer and scheduler state (tensors and plain types: torch.load(weights_only=True) reads it)."""
        self._require_init()
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "version": self.version}

    def load_train_state(self, state: dict) -> None:
        self._require_init()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])

    def save(self, out_dir: str) -> None:
        """The HF folder of the model; with trainer.lora the adapter in PEFT's format instead (lora.save_adapter)."""
        model = self._require_init()
        if is_lora(model):
            save_adapter(model, out_dir)
        else:
            model.save_pretrained(out_dir)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out_dir)

    def load_adapter(self, path: str) -> None:
        """The adapter saved in checkpoint `path` into this trainer's adapter, exactly (a resume)."""
        model = self._require_init()
        state = read_adapter(path)
        check_adapter_fits(model, state, path)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in state.items():
                params[name].copy_(t)
