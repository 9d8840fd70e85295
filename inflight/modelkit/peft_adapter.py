"""A saved PEFT LoRA adapter (the folder `PeftModel.save_pretrained` writes: adapter_config.json and
adapter_model.safetensors) as the tensors of an adapter update (docs/inference-contract.md, "Adapter updates").

PEFT names a tensor `base_model.model.<module>.lora_A.weight` ([r, in]) / `.lora_B.weight` ([out, r]); the update
names it `<module>.weight.lora_A` / `.lora_B`, after the base parameter it adapts. Scaling is lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora (PEFT's LoraLayer.update_layer). Only what a merge W0 + s * B @ A reproduces
exactly is accepted: plain LoRA on linear layers, one rank and one alpha for every module. DoRA, trained biases,
embedding LoRA, modules_to_save, per-module rank/alpha patterns and fan_in_fan_out (GPT-2's Conv1D) are refused,
naming the setting, instead of being served wrong.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


@dataclass
class PeftAdapter:
    tensors: dict[str, torch.Tensor]  # {<base>.lora_A: [r, in], <base>.lora_B: [out, r]}
    rank: int
    scaling: float


def adapter_scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def update_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's LoRA tensor names (saved, or a live PeftModel's `.lora_A.<adapter>.weight`) -> the update's names.
    Raises ValueError naming tensors that are not LoRA A/B matrices of a linear layer."""
    out, bad = {}, []
    for key, t in state_dict.items():
        m = _KEY.match(key)
        if m is None or ".lora_embedding_" in key or ".lora_magnitude_vector" in key:
            bad.append(key)
            continue
        out[f"{m['module']}.weight.lora_{m['half']}"] = t
    if bad:
        raise ValueError(f"not LoRA A/B matrices of linear layers (only those can be merged): {bad[:5]}"
                         + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    return out


def read_peft_adapter(folder: str) -> PeftAdapter:
    """The adapter saved in `folder`, or ValueError naming what is missing or not supported."""
    cfg_path, st_path = os.path.join(folder, "adapter_config.json"), os.path.join(folder, "adapter_model.safetensors")
    for p in (cfg_path, st_path):
        if not os.path.isfile(p):
            raise ValueError(f"{folder!r} is not a saved PEFT adapter: no {os.path.basename(p)} (a folder written by "
                             "PeftModel.save_pretrained, safetensors format)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters can be merged")
    unsupported = [k for k in ("use_dora", "fan_in_fan_out", "lora_bias", "rank_pattern", "alpha_pattern",
                               "modules_to_save", "use_qalora", "layer_replication") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']!r}")
    if unsupported:
        raise ValueError(f"{cfg_path}: {', '.join(unsupported)} not supported (a plain LoRA merge "
                         "W0 + lora_alpha/r * B @ A would serve other weights than the adapter's)")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", 8))
    tensors = update_names(load_file(st_path, device="cpu"))
    if not tensors:
        raise ValueError(f"{st_path} holds no LoRA tensors")
    return PeftAdapter(tensors, rank, adapter_scaling(rank, alpha, bool(cfg.get("use_rslora", False))))
