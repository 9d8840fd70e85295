"""Bad input names its fix: a GGUF file transformers cannot read, a folder that is not a causal LM, a tokenizer
without the chat template the tasks need (at `inflight train` start and at the server's chat endpoint)."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest

from inflight.cli import main as cli
from inflight.modelkit.check import check_model_dir
from inflight.modelkit.fetch import get_model
from inflight.modelkit.gguf import ModelFetchError


def _gguf(path, arch: str, qtype_name: str):
    """A one-tensor GGUF file with the given architecture and tensor type (zeros: only the header matters)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 2 * gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_that_transformers_cannot_read_is_refused_before_converting(tmp_path, capsys):
    with pytest.raises(ModelFetchError, match="quantized as Q8_1, which gguf/transformers cannot dequantize"):
        get_model(str(_gguf(tmp_path / "q81.gguf", "llama", "Q8_1")), tmp_path / "out")
    with pytest.raises(ModelFetchError, match="architecture 'nosucharch' is not one transformers can load"):
        get_model(str(_gguf(tmp_path / "arch.gguf", "nosucharch", "Q8_0")), tmp_path / "out")
    (tmp_path / "text.gguf").write_text("not a gguf file")
    assert cli(["get-model", str(tmp_path / "text.gguf"), str(tmp_path / "out")]) == 1
    assert "is not a readable GGUF file" in capsys.readouterr().err
    assert cli(["get-model", "no-such-model", str(tmp_path / "out")]) == 1
    assert "unknown model 'no-such-model': one of smollm2-135m-instruct" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def no_template_dir(tiny_model_dir, tmp_path):
    out = tmp_path / "no_template"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def test_folder_checks_name_the_fix(tiny_model_dir, no_template_dir, tmp_path):
    check_model_dir(tiny_model_dir, need_chat_template=True)
    with pytest.raises(ValueError, match="no config.json, so it is not a Hugging Face model folder"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match="is a 'vit' model, not a causal language model"):
        check_model_dir(tmp_path)
    check_model_dir(no_template_dir)  # serving by completions needs no template
    with pytest.raises(ValueError, match="its tokenizer has no chat template, and the tasks send chat messages"):
        check_model_dir(no_template_dir, need_chat_template=True)


def test_train_refuses_a_model_without_chat_template(no_template_dir, tmp_path, capsys):
    rc = cli(["train", "configs/cpu-demo.yaml", f"model.path={no_template_dir}", f"pipeline.run_dir={tmp_path}"])
    assert rc == 2
    assert "has no chat template" in capsys.readouterr().err


def test_server_chat_without_template_is_a_400_naming_the_fix(no_template_dir):
    from inflight.engine.serve import ServerProcess

    with ServerProcess(str(no_template_dir), env={"OMP_NUM_THREADS": "1"}) as srv:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"model": model, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2})
        assert r.status_code == 400 and "has no chat template" in r.json()["error"]["message"], r.text
        r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "1+1=", "max_tokens": 2})
        assert r.status_code == 200, r.text
