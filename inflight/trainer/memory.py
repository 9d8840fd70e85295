"""`trainer.gradient_checkpointing: auto`: recompute activations only when a step would not fit on the device.

Checkpointing costs one more forward per step (~1/3 of the step's FLOPs); it pays only when the activations of a
micro-batch do not fit. The estimate, per rank:

    states      = (4 B master weight + 12 B gradient and AdamW moments per trained parameter) / world size
                  + 2 B per parameter for the bf16 copies under bf16-mixed
    activations = micro_batch_tokens x bytes saved for backward per token (`activation_bytes_per_token`)

and checkpointing stays off when states + activations <= (1 - margin) x the device's available memory (margin:
allocator fragmentation, the head's chunk, collectives' buffers).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

MARGIN = 0.2  # of the available memory, kept free
CHOICES = ("auto", True, False)


def parse_choice(value: bool | str) -> bool | str:
    """True / False / "auto" from the config's value (YAML booleans or the strings auto / true / false)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text in ("true", "false"):
        return text == "true"
    raise ValueError(f"trainer.gradient_checkpointing must be auto, true or false, got {value!r}")


def activation_bytes_per_token(config, precision: str, chunked_head: bool = True) -> int:
    """Bytes autograd keeps per token for the backward of a decoder-only model without checkpointing (HF Llama /
    Qwen layout): per layer, in units of the compute dtype, ~18 h (two RMSNorms' float32 input and output, the
    inputs of the projections, attention output and its log-sum-exp) + 2 kv (k, v) + 4 i (gate, up, silu(gate),
    their product); plus the head: the final hidden state, or with full logits [V] logits and their float32 copy."""
    h = int(config.hidden_size)
    i = int(getattr(config, "intermediate_size", None) or 4 * h)
    heads = int(getattr(config, "num_attention_heads", 1))
    head_dim = int(getattr(config, "head_dim", None) or h // max(1, heads))
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    layers = int(config.num_hidden_layers)
    unit = 2 if precision == "bf16-mixed" else 4
    per_layer = unit * (18 * h + 2 * kv + 4 * i)
    head = 4 * h * 3 if chunked_head else (unit + 4) * int(config.vocab_size)
    return layers * per_layer + head


def state_bytes(n_params: int, n_trained: int, precision: str, world_size: int = 1) -> int:
    """Weights, gradients and AdamW state held per rank for the step."""
    sharded = (4 * n_params + 12 * n_trained) / max(1, world_size)
    return int(sharded + (2 * n_params if precision == "bf16-mixed" else 0))


def needs_checkpointing(states: int, per_token: int, tokens: int, available: int, margin: float = MARGIN) -> bool:
    """True when the step's estimate does not fit in (1 - margin) of the available bytes."""
    return states + per_token * tokens > (1.0 - margin) * available


def available_bytes(device: torch.device) -> int:
    """Memory the step may use: on CUDA the free memory plus what this process already holds (the model it is
    placing), on CPU the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_allocated(device))
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def decide(model: torch.nn.Module, cfg, device: torch.device, world_size: int = 1) -> bool:
    """Whether to enable gradient checkpointing for cfg.gradient_checkpointing (auto: by the estimate)."""
    choice = parse_choice(cfg.gradient_checkpointing)
    if isinstance(choice, bool):
        return choice
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    per_token = activation_bytes_per_token(model.config, cfg.precision, bool(cfg.chunked_head))
    need = needs_checkpointing(state_bytes(n, trained, cfg.precision, world_size), per_token,
                               cfg.micro_batch_tokens, available_bytes(device))
    if world_size > 1 and dist.is_initialized():  # one answer on every rank: a recompute all-gathers (FSDP2)
        flag = torch.tensor([int(need)], device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        need = bool(flag.item())
    return need
