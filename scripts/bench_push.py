"""Push stage of the GPU bench (scripts/gpu_bench.py): the run config's trainer and one built-in server on the same
device, 64 streams generating; after each optimizer step, the time from "optimizer step done" (device synchronised)
to "every server holds it" (the weight client's push returned: every server answered), and the server's pause.
Each weight transport is measured (`--push-transports`, default every one the client has but `file`); the
figure is the fastest transport's median of `--pushes` pushes, the others are in its context.

Runs in a process of its own (FSDP2 at world 1 takes RANK/WORLD_SIZE/MASTER_* from the driver).
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench_common import Report, device_sync, log, model_shape, run_config
from bench_engine import Background, start_server, token_request
from smoke_trainer import behaviour_logprobs, packed_samples, train_step


def transports(a: Any) -> list[str]:
    from inflight.trainer.weight_sync.inflight import TRANSPORTS

    if a.push_transports:
        return a.push_transports.split(",")
    # the one expected fastest first (on a GPU cuda_ipc, the one meant to meet the goal): a stage stopped at its
    # cap has measured it; file last, and only when asked for (a safetensors write and read per push, s at 1 GB)
    first = ("cuda_ipc", "shm", "process_group") if a.device.startswith("cuda") else ("shm", "process_group")
    return [t for t in first if t in TRANSPORTS] + [t for t in TRANSPORTS if t not in first and t != "file"]


def report(rep: Report, results: dict[str, dict], a: Any, cfg: Any) -> None:
    """push_s and push_pause_s: the fastest transport so far."""
    best = min(results, key=lambda t: results[t]["push_s_median"])
    common = {"transport": best, "streams": a.streams[0], "dtype": cfg.server.dtype, "trainer": cfg.trainer.backend,
              "bytes": results[best]["pushes"][0]["bytes"]}
    rep.figure("push_s", results[best]["push_s_median"], **common, transports=results)
    rep.figure("push_pause_s", results[best]["pause_s_median"], **common)


def run(a: Any, rep: Report, models: dict[str, str], out: Path) -> None:
    import httpx
    import torch

    from inflight.trainer.factory import make_trainer

    model = models["tied"]
    shape = model_shape(model)
    cfg = run_config(a, [f"trainer.micro_batch_tokens={a.push_step_tokens}"])
    # the server starts while the trainer loads (both read the model from disk and set up the device)
    started: dict[str, Any] = {}

    def serve() -> None:
        try:
            started["server"] = start_server(a, cfg, model, out, rep)
        except BaseException as e:  # noqa: BLE001  (re-raised on the main thread)
            started["error"] = e

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    engine = make_trainer(model, cfg.trainer)
    engine.init()
    samples = packed_samples(a.push_step_tokens, shape["vocab"])
    behaviour_logprobs(engine, samples)
    thread.join()
    if "error" in started:
        raise started["error"]
    with started["server"] as server:
        url = server.url
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        req = token_request(name, shape["vocab"], lambda r: a.prompt_tokens, lambda r: a.new_tokens)
        results: dict[str, dict] = {}
        failed: dict[str, str] = {}
        for transport in transports(a):
            try:
                pushes, load, tcfg = measure(a, transport, engine, samples, url, name, req)
            except Exception as e:  # noqa: BLE001  (the other transports are still measured; the stage fails)
                failed[transport] = f"{type(e).__name__}: {e}"[:1000]
                rep.data["transport_errors"] = failed
                rep.write()
                log(f"push over {transport} FAILED: {failed[transport]}")
                continue
            results[transport] = {"push_s_median": statistics.median(p["seconds"] for p in pushes),
                                  "pause_s_median": statistics.median(p["pause_s"] for p in pushes),
                                  "pushes": pushes, "tokens_per_s_during": load.get("tokens_per_s"),
                                  "backend": tcfg.trainer.weight_backend if transport == "process_group" else None}
            log(f"push over {transport}: {results[transport]['push_s_median']:.3f} s "
                f"(pause {results[transport]['pause_s_median']:.4f} s)")
            report(rep, results, a, cfg)  # after each transport: a stage stopped at its cap keeps the figures
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if failed:
        raise RuntimeError(f"transport(s) failed: {failed}")


def measure(a: Any, transport: str, engine: Any, samples: list, url: str, name: str,
            req: Any) -> tuple[list[dict], dict, Any]:
    """`a.pushes` pushes over `transport`, each after an optimizer step, while `a.streams[0]` streams generate."""
    import httpx

    from inflight.process import free_port
    from inflight.trainer.weight_sync import make_weight_sync

    cuda = a.device.startswith("cuda")
    tcfg = run_config(a, [f"trainer.weight_transport={transport}", f"pipeline.weight_sync_port={free_port()}"])
    sync = make_weight_sync(tcfg, [url])
    sync.init_process_group()
    bg = Background(url, name, a.streams[0], req)
    pushes = []
    try:
        time.sleep(1.0)  # every stream running
        for _ in range(a.pushes):
            train_step(engine, samples, a.push_step_tokens, cuda)
            device_sync(a.device)
            t0 = time.perf_counter()  # optimizer step done
            version = httpx.get(url + "/health").json().get("version", 0) + 1
            st = sync.push(engine.named_weights(), version=version)
            pushes.append({"seconds": time.perf_counter() - t0, "pause_s": st["pause_s"][url],
                           "bytes": st["bytes"], "client_seconds": st["seconds"]})
            if httpx.get(url + "/health").json().get("version") != version:
                raise RuntimeError(f"{transport}: the server does not hold version {version}")
    finally:
        load = bg.stop()
        sync.close()
    return pushes, load, tcfg
