"""Pipeline stage of the GPU bench (scripts/gpu_bench.py): `inflight train configs/gpu-arith-1gpu.yaml` (the demo's
task at GPU scale, trainer and one built-in server sharing the GPU), the model made and warm-started here (the
demo's own `prepare_model`), then one pipelined and one sync run of the same length. Figures: samples/s pipelined /
sync, and time to a held-out accuracy target (warm-start accuracy + `--target-gain`) sync / pipelined, read from the
runs' metrics.jsonl as bench/pipeline.py reads them (times from "servers ready")."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import ROOT, Report, log

from bench.pipeline import read_run, time_to  # noqa: E402  (the repo root is on the path: gpu_bench.py)

CONFIG = ROOT / "configs" / "gpu-arith-1gpu.yaml"
# --device cpu: the same runs, small (the dry run): CPU roles, the micro model, short runs
CPU = ["pipeline.server_devices=[]", "pipeline.trainer_devices=''", "trainer.device=cpu", "trainer.threads=1",
       "server.threads=1", "model.size=micro", "task.eval_size=20", "actor.group_size=4", "actor.groups_per_step=4",
       "actor.reward_workers=1", "server.max_batch=64", "pipeline.max_steps=4", "trainer.micro_batch_tokens=4096"]


def overrides(a: Any, out: Path) -> list[str]:
    cpu = [] if a.device.startswith("cuda") else CPU
    return [f"model.path={out / 'arith-model'}", *cpu, *a.pipeline_set]


def summary_of(r: dict) -> dict:
    return {k: r.get(k) for k in ("steps", "samples", "wall_s", "samples_per_s", "first_acc", "best_acc",
                                  "last_acc", "trainer_busy", "trainer_wait", "server_running")}


def run(a: Any, rep: Report, models: dict[str, str], out: Path) -> None:
    from gpu_smoke import run_launcher

    from inflight.config import RunConfig, load_config
    from inflight.pipeline.demo import prepare_model
    from inflight.process import free_port

    deadline = a.deadline  # from the stage's start (the driver's clock), less the time to stop
    base = overrides(a, out)
    cfg = load_config(RunConfig, CONFIG, base)
    t0 = time.perf_counter()
    prepare_model(cfg, sft_target=a.sft_target, sft_steps=a.sft_steps)
    warm_s = time.perf_counter() - t0
    if a.device.startswith("cuda"):  # the runs get the GPU: free what the warm start's trainer cached
        import torch

        torch.cuda.empty_cache()
    # both runs get the same length: what is left, less each run's start-up and shutdown
    run_s = min(a.pipeline_run_s, (deadline - time.monotonic() - 2 * a.run_overhead_s) / 2)
    if run_s < 10:
        raise RuntimeError(f"{run_s:.0f} s left per run after the warm start ({warm_s:.0f} s)")
    log(f"pipeline: warm start took {warm_s:.0f} s; two runs of {run_s:.0f} s")
    runs_dir = out / "pipeline"
    runs: dict[str, dict] = {}
    for mode in ("pipelined", "sync"):
        cmd = [sys.executable, "-m", "inflight.cli", "train", str(CONFIG), *base, f"name={mode}",
               f"pipeline.mode={mode}", f"pipeline.run_dir={runs_dir}", f"pipeline.max_minutes={run_s / 60:.4f}",
               f"server.base_port={free_port()}", f"pipeline.weight_sync_port={free_port()}"]
        # the first run may overrun its share by what the second does not need; the stage's cap bounds both
        limit = deadline - time.monotonic() - 5 - (run_s + a.run_overhead_s if mode == "pipelined" else 0)
        limit = min(max(limit, run_s + a.run_overhead_s), deadline - time.monotonic())
        rc, output = run_launcher(cmd, limit, out / f"pipeline-{mode}.log")
        if rc != 0:
            raise RuntimeError(f"inflight train ({mode}) exited {rc}: {output[-1500:]}")
        runs[mode] = read_run(runs_dir / mode)
        rep.data[f"run_{mode}"] = summary_of(runs[mode])  # kept if the next run is stopped at the cap
        rep.write()
        log(f"pipeline {mode}: {runs[mode].get('steps')} steps, {runs[mode].get('samples_per_s') or 0:.0f} samples/s, "
            f"held-out {[round(acc, 3) for _, acc, _ in runs[mode].get('evals', [])]}")
    p, s = runs["pipelined"], runs["sync"]
    if not (p.get("samples_per_s") and s.get("samples_per_s")):
        raise RuntimeError(f"a run trained nothing: pipelined {p.get('steps')} steps, sync {s.get('steps')}")
    firsts = [r["first_acc"] for r in (p, s) if r.get("first_acc") is not None]
    start_acc = statistics.median(firsts) if firsts else 0.0
    target = round(start_acc + a.target_gain, 4)
    summary = {m: summary_of(r) for m, r in runs.items()}
    common = {"config": str(CONFIG.relative_to(ROOT)), "overrides": base, "run_s": run_s, "warm_start_s": warm_s,
              "runs": summary}
    rep.figure("pipelined_vs_sync_samples", p["samples_per_s"] / s["samples_per_s"], **common)
    t_p, t_s = time_to(p, target), time_to(s, target)
    times = {"target": target, "start_acc": start_acc, "pipelined_s": t_p, "sync_s": t_s,
             "evals": {m: [(round(t, 1), acc) for t, acc, _ in r.get("evals", [])] for m, r in runs.items()}}
    if t_p is None:
        ratio, note = None, "the pipelined run did not reach the target"
    elif t_s is None:  # sync never got there: it would have taken at least its whole run
        ratio, note = s["wall_s"] / t_p, "lower bound: the sync run did not reach the target in its run"
    else:
        ratio, note = t_s / t_p, "sync / pipelined"
    rep.figure("pipelined_vs_sync_time_to_target", ratio, note=note, **times)
