"""Is a folder a model inflight can run? Checked before any process starts, from the folder's JSON files only
(no weights loaded), so a wrong `model.path` fails in a second with a message that names the fix."""

from __future__ import annotations

import json
from pathlib import Path

FIX = "build one with `inflight make-model`, fetch one with `inflight get-model`, or save one with save_pretrained"


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None


def has_chat_template(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    cfg = d / "tokenizer_config.json"
    return cfg.is_file() and bool(_json(cfg).get("chat_template"))


def check_model_dir(model_dir: str | Path, need_chat_template: bool = False) -> None:
    """ValueError naming the problem and the fix: not a Hugging Face folder, not a causal LM (by its config's
    model_type), or (need_chat_template) a tokenizer without a chat template."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # lazy: loads torch (seconds)

    d = Path(model_dir)
    if not d.is_dir():
        raise ValueError(f"model '{d}' is not a folder ({FIX})")
    if not (d / "config.json").is_file():
        raise ValueError(f"model '{d}' has no config.json, so it is not a Hugging Face model folder ({FIX})")
    model_type = _json(d / "config.json").get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model '{d}' is a {model_type!r} model, not a causal language model that "
                         f"AutoModelForCausalLM can load; RL needs a text-generating (decoder) model ({FIX})")
    if need_chat_template and not has_chat_template(d):
        raise ValueError(f"model '{d}': its tokenizer has no chat template, and the tasks send chat messages "
                         "(rendered by that template); use a chat / instruct model, or add the template the model "
                         "was trained with to the folder (chat_template.jinja, or `chat_template` in "
                         "tokenizer_config.json)")
