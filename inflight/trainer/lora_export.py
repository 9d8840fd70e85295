"""`inflight export-merged CKPT OUT`: a LoRA checkpoint (trainer.lora: PEFT's adapter files) merged into its base
as a plain HF folder, W = W0 + s * B @ A by PEFT's merge_and_unload, loadable by AutoModelForCausalLM (and by
`inflight serve`, vLLM, ...) without PEFT.

    inflight export-merged runs/demo/checkpoints/final runs/demo/merged [--base runs/models/tiny]

The base is --base, else the one the adapter names (adapter_config.json: base_model_name_or_path, the run's
model.path).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from inflight.trainer.lora import ADAPTER_CONFIG, has_adapter


def base_of(ckpt: str | Path, base: str | None = None) -> str:
    """The base model folder of adapter checkpoint `ckpt` (ValueError naming what is missing)."""
    if not has_adapter(ckpt):
        raise ValueError(f"{ckpt} holds no LoRA adapter (adapter_model.safetensors): a checkpoint of a run with "
                         "trainer.lora is needed; a full fine-tuning checkpoint is already a merged HF folder")
    base = base or json.loads((Path(ckpt) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ValueError(f"the base model of {ckpt} ({base!r}) is not a folder here: give it with --base")
    return str(base)


def merged_model(ckpt: str | Path, base: str | None = None):
    """The adapter of `ckpt` merged into its base, in memory (float32, the trainer's precision)."""
    from peft import PeftModel  # lazy: ~4 s to import; `inflight export-merged --help` answers without it
    from transformers import AutoModelForCausalLM  # lazy: as peft (the CLI imports this module)

    model = AutoModelForCausalLM.from_pretrained(base_of(ckpt, base), dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(ckpt)).merge_and_unload()


def export_merged(ckpt: str | Path, out: str | Path, base: str | None = None) -> Path:
    """Write the merged model and the tokenizer to `out`; returns it."""
    from transformers import AutoTokenizer  # lazy: as merged_model's imports

    base = base_of(ckpt, base)
    merged = merged_model(ckpt, base)
    out = Path(out)
    merged.save_pretrained(out)
    tok_from = ckpt if (Path(ckpt) / "tokenizer_config.json").exists() else base
    AutoTokenizer.from_pretrained(str(tok_from)).save_pretrained(out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder of a run with trainer.lora (e.g. .../checkpoints/final)")
    parser.add_argument("out", help="the merged HF folder to write")
    parser.add_argument("--base", default=None, help="the base model folder (default: the adapter's, the run's "
                        "model.path)")


def run(args: argparse.Namespace) -> int:
    try:
        out = export_merged(args.checkpoint, args.out, args.base)
    except ValueError as e:
        print(f"inflight export-merged: {e}")
        return 2
    print(f"merged model written to {out}")
    return 0
