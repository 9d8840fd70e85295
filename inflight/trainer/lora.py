"""LoRA adapters in the trainer (`trainer.lora`), built by PEFT: no LoRA layer is written here.

    model = add_adapter(model, cfg.lora, model_path)   # PEFT injects its layers in place; base frozen
    spec = adapter_spec(model)                          # {"rank": r, "scaling": s}, the update's `adapter`
    for name, t in adapter_tensors(model): ...          # "<base>.lora_A" [r, in], "<base>.lora_B" [out, r]

The trainer keeps the plain HF model (LlamaForCausalLM, ...) with PEFT's layers injected, not PEFT's wrapper:
its forward, FSDP2's sharding by block, the fused CPU kernels and the packed attention see the same modules as in
full fine-tuning (an adapted projection is a `peft.tuners.lora.Linear` whose forward is base(x) + s * B(A(x))).
Names. In the injected model the weight `model.layers.0.self_attn.q_proj.weight` lives at `...q_proj.base_layer.
weight` and the adapter at `...q_proj.lora_A.default.weight`; the weight-update contract names the adapter by the
base's name in the plain model (`<base>.lora_A`), and PEFT's own files by `base_model.model.<module>.lora_A.weight`.
Only LoRA on linear layers fits the contract's W = W0 + s * B @ A; a target that is an embedding, a tied alias, or
that PEFT gives a per-layer rank or alpha is refused at init.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from safetensors.torch import load_file, save_file

from inflight.config.trainer import LoraConfig
from inflight.transport.layout import tied_aliases
from inflight.trainer.weight_sync.gather import gathered

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer
    from transformers import PreTrainedModel

ADAPTER = "default"  # PEFT's adapter name; one adapter per model
PEFT_PREFIX = "base_model.model."  # what PEFT's files put before a module name
ADAPTER_FILE = "adapter_model.safetensors"  # PeftModel.save_pretrained's file names
ADAPTER_CONFIG = "adapter_config.json"


def check_lora(cfg: LoraConfig) -> None:
    if cfg.rank < 1:
        raise ValueError(f"trainer.lora.rank must be >= 1, got {cfg.rank}")
    if cfg.alpha <= 0:
        raise ValueError(f"trainer.lora.alpha must be > 0, got {cfg.alpha}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"trainer.lora.dropout must be in [0, 1), got {cfg.dropout}")
    if not cfg.target_modules:
        raise ValueError("trainer.lora.target_modules is empty (all-linear: every linear layer but the head)")


def peft_config(cfg: LoraConfig, model_path: str | None = None) -> Any:
    import peft  # lazy: ~4 s to import; only a LoRA run needs it (checkpoint.py reads this module for has_adapter)

    check_lora(cfg)
    targets = list(cfg.target_modules)
    return peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # peft annotates int; scaling = alpha / r
        lora_dropout=cfg.dropout, use_rslora=cfg.rslora, bias="none",
        target_modules="all-linear" if targets == ["all-linear"] else targets, task_type="CAUSAL_LM",
        base_model_name_or_path=model_path)


def add_adapter(model: PreTrainedModel, cfg: LoraConfig, model_path: str | None = None) -> PreTrainedModel:
    """The same model object with PEFT's LoRA layers injected (B = 0: the output is the base model's) and only
    the adapter trainable. The resolved PEFT config is kept as `model.inflight_lora` (saved with the adapter)."""
    from peft import get_peft_model  # lazy: as in peft_config

    aliases = set(tied_aliases(model))
    wrapped = get_peft_model(model, peft_config(cfg, model_path))
    inner = wrapped.base_model.model
    layers = lora_layers(inner)
    if not layers:
        raise ValueError(f"trainer.lora.target_modules {list(cfg.target_modules)} matches no linear layer")
    bad = [n for n, m in layers if not isinstance(m.base_layer, torch.nn.Linear) or f"{n}.weight" in aliases]
    if bad:
        raise ValueError(f"trainer.lora: {bad[:3]} are not plain linear layers of their own (an embedding or a tied "
                         "weight): an adapter update names linear weights only")
    for name, p in inner.named_parameters():  # PEFT froze the base; say so here too, whatever its defaults
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    inner.inflight_lora = wrapped.peft_config[ADAPTER]
    adapter_spec(inner)  # one rank and scaling for all layers, or an error now
    return inner


def lora_layers(model: torch.nn.Module) -> list[tuple[str, LoraLayer]]:
    """(module name in the plain model, PEFT LoRA layer) of every adapted linear layer, in module order."""
    from peft.tuners.lora import LoraLayer  # lazy: as in peft_config

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A]


def is_lora(model: torch.nn.Module) -> bool:
    return getattr(model, "inflight_lora", None) is not None


def adapter_spec(model: torch.nn.Module) -> dict[str, float]:
    """{"rank", "scaling"} of the adapter (the update's `adapter`); ValueError if the layers disagree."""
    found = {(int(m.r[ADAPTER]), float(m.scaling[ADAPTER])) for _, m in lora_layers(model)}
    if len(found) != 1:
        raise ValueError(f"trainer.lora: the adapted layers have different (rank, scaling) {sorted(found)}; an "
                         "adapter update has one")
    rank, scaling = found.pop()
    return {"rank": rank, "scaling": scaling}


def adapter_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The contract's tensors: `<base>.lora_A` [r, in] then `<base>.lora_B` [out, r] per adapted layer, where
    `<base>` is the layer's weight name in the plain model. FSDP2: gathered one tensor at a time (collective), each
    shard cast to `dtype` first."""
    for name, m in lora_layers(model):
        yield f"{name}.weight.lora_A", gathered(_weight(m.lora_A[ADAPTER]), dtype)
        yield f"{name}.weight.lora_B", gathered(_weight(m.lora_B[ADAPTER]), dtype)


def _weight(linear: torch.nn.Module) -> torch.Tensor:
    weight = linear.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(linear).__name__}.weight is not a tensor")
    return weight


def to_peft_names(tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contract names -> the keys of PEFT's adapter_model.safetensors."""
    out = {}
    for name, t in tensors:
        base, half = name.rsplit(".", 1)  # "<module>.weight", "lora_A"
        out[f"{PEFT_PREFIX}{base.removesuffix('.weight')}.{half}.weight"] = t
    return out


def save_adapter(model: torch.nn.Module, out_dir: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """PEFT's format (PeftModel.from_pretrained(base, out_dir) loads it): adapter_config.json and
    adapter_model.safetensors. `tensors`: the contract-named tensors already gathered (FSDP2's rank 0)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    named = tensors.items() if tensors is not None else adapter_tensors(model)
    state = {k: v.cpu().contiguous() for k, v in to_peft_names(iter(named)).items()}
    save_file(state, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    config = getattr(model, "inflight_lora", None)  # PEFT's LoraConfig, set by add_adapter
    if config is None:
        raise ValueError("save_adapter: the model carries no LoRA adapter (add_adapter)")
    config.save_pretrained(str(out))


def has_adapter(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_FILE).is_file()


def read_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    """An adapter saved by save_adapter (or PEFT), keyed by the injected model's parameter names
    (`<module>.lora_A.default.weight`)."""
    out = {}
    for key, t in load_file(str(Path(path) / ADAPTER_FILE)).items():
        if not key.startswith(PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(f"{path}: '{key}' is not a LoRA tensor of PEFT's format")
        module, half, _ = key[len(PEFT_PREFIX):].rsplit(".", 2)
        out[f"{module}.{half}.{ADAPTER}.weight"] = t
    return out


def check_adapter_fits(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Every adapter parameter of the model, with its shape, is in `state` and nothing else is."""
    mine = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    theirs = {n: tuple(t.shape) for n, t in state.items()}
    if mine != theirs:
        missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        shapes = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        raise ValueError(f"the adapter in {path} does not fit trainer.lora (missing {missing[:3]}, unexpected "
                         f"{extra[:3]}, other shapes {shapes[:3]}): resume with the run's trainer.lora")
