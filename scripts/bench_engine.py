"""Engine stage of the GPU bench (scripts/gpu_bench.py): the built-in server on the device, serving the bench's
model as `inflight train` would start it (server.* of the run config), under

- 64 and 256 closed-loop streams (prompt 128 random token ids, 512 new tokens, ignore_eos): generated tokens/s and
  the decode step time, both from the server's /metrics counters over a window once every stream runs, and the
  step's memory floor: bytes read per step (weights + live KV) / the bandwidth of a device-to-device copy measured
  here;
- 256 sequences at once with prompt and output lengths uniform in 100..1024 (mixed);
- five pushes (the run config's transport, from a stand-in model on the device) while 64 streams generate: the
  server's pause; then the served logprobs against a float32 forward of the pushed weights.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench_common import Report, copy_bandwidth, device_sync, log, model_shape, run_config, scrape
from smoke_server import _load, perturb, pythonpath, served_logprob_diffs


def start_server(a: Any, cfg: Any, model: str, out: Path, rep: Report) -> Any:
    """`inflight serve` with the run config's server options, as the pipeline launcher builds them."""
    from inflight.engine.serve import ServerProcess
    from inflight.pipeline.launch_common import engine_options, thread_env

    cuda = a.device.startswith("cuda")
    env = {"PYTHONPATH": pythonpath(), **thread_env(cfg.server.threads)}
    args = [*engine_options(cfg.server, cuda), *[str(x) for x in cfg.server.extra_args]]
    log(f"server: inflight serve {' '.join(args)}")
    # through with_parent.py: the server ends with this stage, even if the stage is killed while it starts
    command = [sys.executable, str(Path(__file__).with_name("with_parent.py")), sys.executable, "-m", "inflight.cli",
               "serve"]
    server = ServerProcess(model, extra_args=args, env=env, startup_timeout_s=300, command=command,
                           log_path=str(out / f"server-{a.child}.log"))
    rep.track(server.proc.pid)  # its own session: the driver stops it if this stage is killed
    return server


def decode_path(log_path: Path) -> str:
    """What the server's start-up log says its decode steps run as (CUDA graphs captured, eager, and why; the line
    is logged at INFO whenever the graph runner starts)."""
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if "decode steps: " in ln]
    return lines[-1].split("decode steps: ", 1)[1] if lines else "eager (no graph runner started)"


def token_request(model: str, vocab: int, prompt: Callable[[random.Random], int],
                  new: Callable[[random.Random], int]) -> Callable[[int, int], tuple[str, dict]]:
    """Request factory for smoke_server._load: random prompt ids (no prefix reuse between requests)."""

    def request(k: int, i: int) -> tuple[str, dict]:
        rng = random.Random(k * 1_000_003 + i)
        ids = [rng.randrange(10, vocab - 10) for _ in range(prompt(rng))]
        return "/v1/completions", {"model": model, "prompt": ids, "max_tokens": new(rng), "ignore_eos": True,
                                   "temperature": 1.0, "seed": k * 7919 + i}

    return request


class Background:
    """smoke_server._load on a thread until stop() (requests in flight are cancelled)."""

    def __init__(self, url: str, model: str, streams: int, request: Callable[[int, int], tuple[str, dict]] | None,
                 seconds: float = 3600.0):
        self.stop_event, self.result = threading.Event(), {}
        self.thread = threading.Thread(target=lambda: self.result.update(asyncio.run(_load(
            url, model, streams, seconds, 16, self.stop_event, request))), daemon=True)
        self.thread.start()

    def stop(self) -> dict:
        self.stop_event.set()
        self.thread.join(timeout=120)
        return self.result


def drain(url: str, timeout_s: float = 30.0) -> None:
    """Until the server runs nothing (the requests a load cancelled are aborted at the next step)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        m = scrape(url)
        if not (m.get("running_requests") or m.get("waiting_requests")):
            return
        time.sleep(0.05)


def steady(url: str, model: str, streams: int, request: Callable, warm_s: float, window_s: float) -> dict[str, Any]:
    """Tokens/s and step time over a window of /metrics once `streams` sequences run (or warm_s passed)."""
    bg = Background(url, model, streams, request)
    try:
        t_start = time.perf_counter()
        while time.perf_counter() - t_start < warm_s and scrape(url).get("running_requests", 0) < streams:
            time.sleep(0.05)
        m0, t0 = scrape(url), time.perf_counter()
        time.sleep(window_s)
        m1, t1 = scrape(url), time.perf_counter()
    finally:
        res = bg.stop()
        drain(url)
    if res.get("errors"):
        raise RuntimeError(f"{streams} streams: {res['errors']} requests failed")
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in ("generated_tokens_total", "engine_steps_total",
                                                       "prefill_tokens_total")}
    if d["engine_steps_total"] <= 0:
        raise RuntimeError(f"{streams} streams: no engine step in {t1 - t0:.1f} s")
    return {"tokens_per_s": d["generated_tokens_total"] / (t1 - t0), "window_s": t1 - t0,
            "steps": d["engine_steps_total"], "step_ms": 1e3 * (t1 - t0) / d["engine_steps_total"],
            "tokens_per_step": d["generated_tokens_total"] / d["engine_steps_total"],
            "prefill_tokens": d["prefill_tokens_total"], "warm_s": t0 - t_start, "client_requests": res.get("requests")}


def floor_ms(shape: dict, itemsize: int, batch: float, context: float, bandwidth: float) -> tuple[float, float]:
    """(ms, bytes) a decode step of `batch` sequences of mean `context` tokens must read: every matmul weight
    once and the live KV (K and V of every layer)."""
    kv_per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * itemsize
    nbytes = shape["matmul_parameters"] * itemsize + batch * context * kv_per_token
    return 1e3 * nbytes / bandwidth, nbytes


async def _once(url: str, n: int, request: Callable[[int, int], tuple[str, dict]], cap_s: float) -> dict:
    """n requests at once, each sent once; those still running after cap_s are cancelled."""
    import httpx

    done = {"requests": 0, "errors": 0}

    async def one(http: httpx.AsyncClient, k: int) -> None:
        path, body = request(k, 0)
        try:
            (await http.post(url + path, json=body)).raise_for_status()
            done["requests"] += 1
        except httpx.HTTPError:
            done["errors"] += 1

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        tasks = [asyncio.create_task(one(http, k)) for k in range(n)]
        _, pending = await asyncio.wait(tasks, timeout=cap_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {**done, "capped": bool(pending)}


def mixed(url: str, model: str, vocab: int, n: int, lo: int, hi: int, cap_s: float) -> dict[str, Any]:
    """n requests at once, prompt and output lengths uniform in lo..hi; generated tokens/s until all end (or
    cap_s: then the rate so far)."""
    req = token_request(model, vocab, lambda r: r.randint(lo, hi), lambda r: r.randint(lo, hi))
    m0, t0 = scrape(url), time.perf_counter()
    res = asyncio.run(_once(url, n, req, cap_s))
    m1, t1 = scrape(url), time.perf_counter()
    drain(url)
    if res["errors"] and not res["capped"]:
        raise RuntimeError(f"mixed: {res['errors']} of {n} requests failed")
    tokens = m1.get("generated_tokens_total", 0.0) - m0.get("generated_tokens_total", 0.0)
    return {"tokens_per_s": tokens / (t1 - t0), "seconds": t1 - t0, "sequences": n, "finished": res["requests"],
            "capped_at_s": cap_s if res["capped"] else None, "lengths": [lo, hi], "generated_tokens": tokens}


def run(a: Any, rep: Report, models: dict[str, str], out: Path) -> None:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from inflight.process import free_port
    from inflight.trainer.weight_sync import make_weight_sync

    model = models["tied"]
    shape = model_shape(model)
    deadline = a.deadline  # from the stage's start (the driver's clock), less the time to stop
    cfg = run_config(a, [f"pipeline.weight_sync_port={free_port()}"])
    s = cfg.server
    s.max_batch, s.max_model_len = max(s.max_batch, a.streams[1]), max(s.max_model_len, 2 * a.mixed_len[1] + 8)
    itemsize = torch.empty(0, dtype=getattr(torch, s.dtype)).element_size()
    bandwidth = copy_bandwidth(a.device, 512 * 2**20 if a.device.startswith("cuda") else 32 * 2**20)
    log(f"device-to-device copy: {bandwidth / 1e9:.0f} GB/s (read + written)")
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the copy's buffers: the server gets the memory
    with start_server(a, cfg, model, out, rep) as server:
        url = server.url
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        p, n_new = a.prompt_tokens, a.new_tokens
        req = token_request(name, shape["vocab"], lambda r: p, lambda r: n_new)
        steady(url, name, a.streams[0], req, 2.0, 0.5)  # warm-up: first-use work stays out of the figures
        for streams, key in zip(a.streams, ("64", "256"), strict=True):
            res = steady(url, name, streams, req, a.warm_s, a.window_s)
            rep.figure(f"engine_tokens_per_s_{key}", res["tokens_per_s"], streams=streams, prompt_tokens=p,
                       new_tokens=n_new, decode_path=decode_path(out / f"server-{a.child}.log"), **res)
            ctx = p + n_new / 2  # mean context over a request's decode steps
            f_ms, f_bytes = floor_ms(shape, itemsize, res["tokens_per_step"], ctx, bandwidth)
            rep.figure(f"engine_step_ms_vs_floor_{key}", res["step_ms"] / f_ms, step_ms=res["step_ms"],
                       floor_ms=f_ms, bytes_per_step=f_bytes, mean_batch=res["tokens_per_step"], mean_context=ctx,
                       copy_bandwidth_gb_s=bandwidth / 1e9, dtype=s.dtype)
        left = deadline - time.monotonic() - a.push_reserve_s
        res = mixed(url, name, shape["vocab"], a.streams[1], *a.mixed_len, cap_s=max(5.0, min(a.mixed_cap_s, left)))
        rep.figure("engine_tokens_per_s_mixed", res["tokens_per_s"], **res)

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, s.dtype)).to(a.device).eval()
        sync = make_weight_sync(cfg, [url])
        sync.init_process_group()
        bg = Background(url, name, a.streams[0], req)
        try:
            time.sleep(min(2.0, a.warm_s))
            pushes, old = [], None
            for v in range(1, 6):
                if v == 5:  # the last one larger: the old weights must explain the served logprobs clearly worse
                    old = {n: t.detach().clone() for n, t in hf.named_parameters()}
                perturb(hf, v, 0.01 if v == 5 else 0.002)
                device_sync(a.device)
                st = sync.push(hf.named_parameters(), version=v)
                pushes.append({"seconds": st["seconds"], "pause_s": st["pause_s"][url], "bytes": st["bytes"]})
                pauses = sorted(x["pause_s"] for x in pushes)
                # after every push: a stage stopped at its cap keeps the pauses so far
                rep.figure("engine_pause_s", pauses[len(pauses) // 2], pause_max_s=pauses[-1], pushes=pushes,
                           transport=cfg.trainer.weight_transport, backend=cfg.trainer.weight_backend,
                           streams=a.streams[0], note=f"median of {len(pushes)} of 5 pushes' server pauses")
        finally:
            load = bg.stop()
            sync.close()
        rep.data["figures"]["engine_pause_s"]["context"]["tokens_per_s_during_pushes"] = load.get("tokens_per_s")
        rep.write()
        diffs = served_logprob_diffs(url, name, hf, old, 5)
        rep.figure("engine_logprob_max_diff", diffs["logprob_max_abs_diff"], **diffs, served_dtype=s.dtype)
        del hf, old
