"""A GGUF checkpoint as a plain Hugging Face folder: float32 safetensors, tokenizer, chat template, generation config.

transformers reads GGUF files (with the `gguf` and `accelerate` packages) and dequantizes them on load, but the
model it returns counts as quantized and refuses `save_pretrained`. So: load it once, build a fresh model from its
config with `quantization_config` removed, load the dequantized state dict into it (tied weights stay tied: the
alias is the one missing key), and save that. The header is checked first, so a file transformers cannot read fails
in a second with a message that names the fix, not after minutes of dequantizing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from inflight.modelkit.stops import stop_token_ids
from inflight.transport.layout import tied_aliases

log = logging.getLogger("inflight.modelkit.gguf")

# tensor types that are plain numbers (no dequantization needed)
_PLAIN = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}


class ModelFetchError(RuntimeError):
    """Getting or converting a model failed; the message names the fix."""


def require_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelFetchError(f"reading a GGUF file needs the package(s) {', '.join(missing)}: "
                              f"pip install {' '.join(missing)} (inflight's own dependencies include them)")


def inspect_gguf(path: Path) -> dict[str, Any]:
    """Architecture and tensor types from the header; ModelFetchError for a file transformers cannot turn into a
    model (not GGUF, an architecture it has no mapping for, a quantization nobody can dequantize)."""
    require_packages()
    import numpy as np  # lazy: numpy + gguf (~0.4 s): only reading a GGUF file needs them
    from gguf import GGML_QUANT_SIZES, GGUFReader, dequantize  # lazy: after require_packages, which names a missing one
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES  # lazy: loads torch (seconds)

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct errors on a foreign file
        raise ModelFetchError(f"{path} is not a readable GGUF file ({str(e).splitlines()[0][:200]}); "
                              "pass a .gguf checkpoint or a Hugging Face folder") from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
    known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # those two are mapping sections
    if arch not in known:
        raise ModelFetchError(f"{path}: GGUF architecture {arch!r} is not one transformers can load "
                              f"({', '.join(known)}); get the model as a Hugging Face folder instead")
    types = sorted({t.tensor_type.name for t in reader.tensors})
    unreadable = []
    for name in set(types) - _PLAIN:
        qtype = next(t.tensor_type for t in reader.tensors if t.tensor_type.name == name)
        try:  # one block of zeros: raises NotImplementedError for a type gguf cannot dequantize
            dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
        except NotImplementedError:
            unreadable.append(name)
    if unreadable:
        raise ModelFetchError(f"{path}: tensors quantized as {', '.join(sorted(unreadable))}, which gguf/transformers "
                              "cannot dequantize; use a GGUF file of another quantization (Q4_0, Q4_1, Q8_0, Q4_K, "
                              "Q6_K, F16, ...) or the model's Hugging Face folder")
    return {"architecture": arch, "tensor_types": types, "tensors": len(reader.tensors)}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the plain HF folder for `gguf_path` to `out_dir` (built next to it, renamed into place when complete)
    and return what `inflight_source.json` in it records."""
    import torch  # lazy: torch + transformers take seconds; `get-model` on a ready folder needs neither
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: as torch above

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    header = inspect_gguf(gguf_path)
    t0 = time.perf_counter()
    kw = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise ModelFetchError(f"transformers could not load {gguf_path} as a causal LM: {e}") from e
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = loaded.state_dict()
    result = model.load_state_dict(state, strict=False)
    aliases = tied_aliases(model)
    missing = [k for k in result.missing_keys if k not in aliases]
    if missing or result.unexpected_keys:
        raise ModelFetchError(f"{gguf_path}: the dequantized weights do not fit the model built from its config "
                              f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})")
    model.tie_weights()
    del loaded, state
    gen = model.generation_config
    ids = sorted(stop_token_ids(cfg, gen, tokenizer))  # HF generate then stops where the engine does
    gen.eos_token_id = ids[0] if len(ids) == 1 else ids
    if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {**(source or {}), "gguf": gguf_path.name, **header, "parameters": sum(p.numel() for p in model.parameters()),
            "tied": sorted(aliases), "eos_token_ids": ids, "convert_seconds": round(time.perf_counter() - t0, 1)}
    (tmp / "inflight_source.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    log.info("converted %s -> %s in %.1f s", gguf_path, out_dir, time.perf_counter() - t0)
    return info
