"""What `trainer.lora` with `trainer.protocol: vllm` costs on a stock vLLM server (not a test).

    INFLIGHT_VLLM_PYTHON=.cache/vllm-venv/bin/python .venv/bin/python bench/vllm_lora.py \
        [--model .cache/models/smollm2-135m-instruct] [--rank 8] [--pushes 3] [--tokens 128] [--batch 1,8]

Two stock servers in turn (`python -m vllm.entrypoints.openai.api_server`, float32, -O0, OMP_NUM_THREADS=1):
1. `--enable-lora --max-lora-rank R` with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: `--pushes` adapters of rank R on every
   linear weight of every layer pushed by the real client (trainer/protocols/vllm_lora.py); per push the save seconds
   (PEFT folder) and the load seconds (/v1/load_lora_adapter answered); then greedy decode tokens/s under the adapter,
   under the base model on the same server, and under the same adapter loaded with `load_inplace: true`;
2. no LoRA: greedy decode tokens/s of the plain model, which is what merged weights (the inflight protocol's
   adapter path) decode at.
Decode tokens/s: `--batch` concurrent requests of `--tokens` tokens each (ignore_eos), total tokens / wall seconds,
median of 2 rounds after one warm-up. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight.engine.serve import ServerProcess  # noqa: E402
from inflight.trainer.weight_sync.vllm_lora import VLLMLoraSync, checkpoint_shapes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "1"}


def decode_tps(url: str, model: str, tokens: int, batch: int) -> float:
    def one(i: int) -> int:
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": model, "prompt": f"Count to {100 + i}:", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    rates = []
    with cf.ThreadPoolExecutor(batch) as pool:
        for round_ in range(3):
            t0 = time.perf_counter()
            n = sum(pool.map(one, range(batch)))
            if round_:  # the first round warms up
                rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def adapter(shapes: dict, rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, shape in shapes.items():
        if n.endswith("_proj.weight"):
            out[n + ".lora_A"] = 1e-2 * torch.randn(rank, shape[1], generator=g)
            out[n + ".lora_B"] = 1e-2 * torch.randn(shape[0], rank, generator=g)
    return out


def server(model: str, python: str, extra: list[str]) -> ServerProcess:
    return ServerProcess(model, command=[python, "-m", "vllm.entrypoints.openai.api_server"], env=ENV,
                         extra_args=["--dtype", "float32", "--max-model-len", "1024", "-O0", *extra],
                         startup_timeout_s=600)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", default="1,8")
    args = ap.parse_args()
    python = os.environ["INFLIGHT_VLLM_PYTHON"]
    batches = [int(b) for b in args.batch.split(",")]
    shapes = checkpoint_shapes(args.model)
    out: dict = {"model": Path(args.model).name, "rank": args.rank, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as tmp, server(args.model, python, [
            "--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", "2"]) as srv:
        base = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        client = VLLMLoraSync([srv.url], Path(tmp) / "adapters", name="bench", keep=2, base_shapes=shapes)
        client.init_process_group()
        stats = [client.push(adapter(shapes, args.rank, v).items(), version=v,
                             adapter={"rank": args.rank, "scaling": 2.0}) for v in range(1, args.pushes + 1)]
        out["adapter_mb"] = stats[0]["bytes"] / 1e6
        out["num_tensors"] = stats[0]["num_tensors"]
        out["save_s"] = statistics.median(s["save_s"] for s in stats)
        out["load_s"] = statistics.median(s["load_s"] for s in stats)
        name = stats[-1]["adapter"]["name"]
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={
            "lora_name": "inplace", "lora_path": stats[-1]["adapter"]["path"], "load_inplace": True})
        assert r.status_code == 200, r.text
        for b in batches:
            out[f"tps_lora_b{b}"] = decode_tps(srv.url, name, args.tokens, b)
            out[f"tps_base_on_lora_server_b{b}"] = decode_tps(srv.url, base, args.tokens, b)
            out[f"tps_lora_inplace_b{b}"] = decode_tps(srv.url, "inplace", args.tokens, b)
        client.close()
    with server(args.model, python, []) as srv:
        base = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        for b in batches:
            out[f"tps_plain_b{b}"] = decode_tps(srv.url, base, args.tokens, b)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
