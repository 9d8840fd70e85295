"""Which token ids end a generation: every id of the generation config's `eos_token_id` (the model config's when
the generation config has none), the tokenizer's eos, and the token that ends a turn in the chat template.

The last one matters for chat use of models whose configs name only the end-of-text token (a base model given a
ChatML template, e.g. Qwen2.5 base: eos <|endoftext|>, turns end with <|im_end|>): a reply must stop where the
template would close the assistant's turn, or it runs on into a made-up next turn."""

from __future__ import annotations

from typing import Any

_SENTINEL = "\u2063inflight-reply\u2063"  # text no template adds by itself


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template writes right after an assistant message, or None (no template, or the
    template puts plain text there)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1"},
                                              {"role": "assistant", "content": _SENTINEL}], tokenize=False)
    except Exception:  # a template may insist on its own roles or order
        return None
    if not isinstance(text, str) or _SENTINEL not in text:
        return None
    after = text.split(_SENTINEL, 1)[1]
    ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return int(ids[0]) if ids and ids[0] in special else None


def stop_token_ids(model_config: Any, generation_config: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a generation (see the module docstring); ignore_eos switches all of them off."""
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    ids = set(_ids(eos if eos is not None else getattr(model_config, "eos_token_id", None)))
    ids.update(_ids(getattr(tokenizer, "eos_token_id", None)))
    eot = end_of_turn_id(tokenizer)
    if eot is not None:
        ids.add(eot)
    return ids
