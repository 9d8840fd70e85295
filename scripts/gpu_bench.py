"""The GPU bench (driven by scripts/gpu-bench.sh; docs/backends.md "How to run on a lent GPU"): one GPU, <= 8 min.

    python scripts/gpu_bench.py --out runs/gpu-bench                      # everything, one CUDA GPU
    python scripts/gpu_bench.py --out runs/gpu-bench --stages engine,trainer
    python scripts/gpu_bench.py --out /tmp/bench --device cpu --tiny      # every stage, small, on CPU (a dry run)

Stages (each in a process of its own, stopped at its time cap; the figures it measured before a crash or the cap
are kept): engine (scripts/bench_engine.py), trainer (bench_trainer.py), push (bench_push.py), pipeline
(bench_pipeline.py). Before them, `models` builds the Qwen2.5-0.5B-shaped model (random weights, tied head; the
smoke's builder) unless it is there. The servers and trainers are built from the run config (--config, default
configs/gpu-qwen2.5-gsm8k.yaml, laid out on one GPU; --set key=value for any server.* / trainer.* option); the
pipeline stage runs configs/gpu-arith-1gpu.yaml (--pipeline-set key=value).

Writes OUT/bench.json after every stage: each figure as {"value", "goal", "met", "context"} (met null, with a
"reason", where the value cannot mean what the goal means: on CPU, or a GPU whose bf16 peak is unknown), the stages'
seconds, caps and errors; the log is OUT/bench.log (scripts/gpu-bench.sh tees it). Exit 0 when every stage ran and reported
all its figures (goals met or not), else 1 naming the failed stages.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import GOALS, STAGES, Report, judged, keys_of, log  # noqa: E402  (scripts/ is this file's folder)
from smoke_server import pythonpath  # noqa: E402

# seconds per stage on the GPU (they add up to the default budget, 480 s; the pipeline's two runs get what its warm
# start leaves, up to 90 s each); --tiny runs on a shared CPU, where the caps only stop a hang
CAPS = {"models": 30, "engine": 110, "trainer": 45, "push": 55, "pipeline": 240}
TINY_CAPS = {"models": 60, "engine": 120, "trainer": 60, "push": 90, "pipeline": 150}
GRACE_S = 20  # after SIGTERM at the cap: the stage stops its servers and runs, then SIGKILL
STOP_S = 8  # a stage plans to end this long before its cap: writing its figures and stopping its server take time


def scale(a: argparse.Namespace) -> None:
    """The loads: the bench's on a GPU, small ones with --tiny (the same code paths)."""
    t = a.tiny
    a.streams = (8, 32) if t else (64, 256)
    a.prompt_tokens, a.new_tokens = (16, 32) if t else (128, 512)
    a.warm_s, a.window_s = (3.0, 2.0) if t else (10.0, 8.0)
    a.mixed_len = (8, 48) if t else (100, 1024)
    a.mixed_cap_s, a.push_reserve_s = (20.0, 20.0) if t else (40.0, 25.0)
    a.packed_tokens = 1024 if t else 16384
    a.sample_len = (48, 96) if t else (768, 1280)
    a.push_step_tokens, a.pushes = (512, 3) if t else (4096, 3)
    a.sft_target, a.sft_steps = (0.25, 8) if t else (0.3, 400)
    a.pipeline_run_s = 15.0 if t else 90.0
    a.run_overhead_s = 25.0 if t else 30.0
    a.target_gain = 0.0 if t else 0.2


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu-bench")
    ap.add_argument("--device", default="cuda", help="cuda (one GPU) or cpu (a dry run, with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="small model and loads (the CPU dry run)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--config", default=str(ROOT / "configs" / "gpu-qwen2.5-gsm8k.yaml"),
                    help="run config the engine, trainer and push stages build their server and trainer from")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override of that run config (repeatable), e.g. --set server.max_batch=512")
    ap.add_argument("--pipeline-set", action="append", default=[], metavar="KEY=VALUE",
                    help="override of configs/gpu-arith-1gpu.yaml for the pipeline stage (repeatable)")
    ap.add_argument("--push-transports", default="", help="comma-separated (default: every transport but file)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="whole-run limit (default 480 on a GPU)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # runs one stage: the driver's subprocess
    ap.add_argument("--ends-at", type=float, default=0.0, help=argparse.SUPPRESS)  # the stage's cap, time.time()
    a = ap.parse_args(argv)
    a.selected = [s for s in a.stages.split(",") if s]
    bad = [s for s in a.selected if s not in STAGES]
    if bad:
        ap.error(f"unknown stage(s) {bad}; choose from {','.join(STAGES)}")
    a.budget_s = a.budget_s or (sum(TINY_CAPS.values()) if a.tiny else 480.0)
    scale(a)
    return a


def child(a: argparse.Namespace) -> int:
    """One stage, in this process; its figures go to OUT/stage-NAME.json as they are measured."""
    import importlib

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # stops servers, runs
    # the deadline counts from the driver's start of this process (its imports included), not from here
    a.deadline = time.monotonic() + (a.ends_at - time.time()) - STOP_S
    watch_parent()
    out = Path(a.out).resolve()
    rep = Report(out / f"stage-{a.child}.json")
    try:
        if a.child == "models":
            from gpu_smoke import build_models  # the smoke's model builder

            rep.data["models"] = build_models(out, a.tiny, "bfloat16" if a.device.startswith("cuda") else "float32",
                                              ties=(True,))
        else:
            models = json.loads((out / "stage-models.json").read_text()).get("models", {}) \
                if (out / "stage-models.json").exists() else {}
            importlib.import_module(f"bench_{a.child}").run(a, rep, models, out)
        rep.write()
        return 0
    except BaseException as e:  # noqa: BLE001  (every failure is reported the same way, in the stage's file)
        traceback.print_exc()
        rep.data["error"] = f"{type(e).__name__}: {e}"[:3000]
        rep.write()
        return 1


def watch_parent() -> None:
    """A stage whose driver is gone (killed) stops itself as at its cap: SIGTERM, then the group's SIGKILL."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def run_stage(a: argparse.Namespace, name: str, cap: float, argv: list[str]) -> dict[str, Any]:
    """The stage as a subprocess (its own process group) under `cap` seconds; its report file, read back."""
    from inflight.process import free_port

    out = Path(a.out).resolve()
    path = out / f"stage-{name}.json"
    if name != "models":
        path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": pythonpath(),
           # FSDP2 at world 1 (trainer, push): the rendezvous of a one-rank group
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()),
           **({} if a.device.startswith("cuda") else {"OMP_NUM_THREADS": "1"})}
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", name, "--ends-at",
           f"{time.time() + cap:.3f}"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    except BaseException:  # Ctrl-C or SIGTERM of the driver: the stage stops what it started
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=GRACE_S)
        raise
    res = json.loads(path.read_text()) if path.exists() else {"figures": {}, "pgids": []}
    for pgid in res.get("pgids", []):  # servers the stage started, if it could not stop them itself
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if timed_out:
        res["error"] = f"stopped at its time cap of {cap:.0f} s" + (f" ({res['error']})" if res.get("error") else "")
    elif proc.returncode and not res.get("error"):
        res["error"] = f"exited {proc.returncode} without a report"
    return res


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    a = parse(raw)
    if a.child:
        return child(a)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cuda = a.device.startswith("cuda")
    meta: dict[str, Any] = {"device": a.device, "tiny": a.tiny, "stages_run": a.selected, "config": a.config,
                            "set": a.set, "budget_s": a.budget_s, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                             time.gmtime())}
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        pass
    import torch

    meta["torch"] = torch.__version__
    if cuda:
        if not torch.cuda.is_available():
            print("gpu_bench: --device cuda but torch sees no GPU (a dry run: --device cpu --tiny)")
            return 2
        meta["gpu"] = torch.cuda.get_device_name(0)
    bench: dict[str, Any] = {"meta": meta, "stages": {}}
    for key in [k for s in a.selected for k in keys_of(s)]:
        bench[key] = judged(key, None, device=a.device)
    caps = TINY_CAPS if a.tiny else CAPS
    todo = (["models"] if set(a.selected) & {"engine", "trainer", "push"} else []) + a.selected
    t_start, failed = time.monotonic(), []
    for name in todo:
        cap = min(caps[name], a.budget_s - (time.monotonic() - t_start))
        if name != "models" and "models" in failed:
            res = {"figures": {}, "error": "no model (the models stage failed)"}
            seconds = 0.0
        elif cap < 15:
            res, seconds = {"figures": {}, "error": f"not run: {cap:.0f} s of the budget left"}, 0.0
        else:
            log(f"{name}: start (cap {cap:.0f} s)")
            t0 = time.monotonic()
            res = run_stage(a, name, cap, raw)
            seconds = time.monotonic() - t0
        for key, f in res.get("figures", {}).items():
            bench[key] = judged(key, f["value"], f.get("context"), a.device, f.get("unjudged"))
        missing = [k for k in keys_of(name) if k not in res.get("figures", {})] if name != "models" else []
        error = res.get("error") or (f"did not report {missing}" if missing else None)
        kept = {k: v for k, v in res.items() if k not in ("figures", "pgids", "error", "models")}  # e.g. one run
        bench["stages"][name] = {"ok": error is None, "seconds": round(seconds, 1), "cap_s": round(cap, 1),
                                 **({"error": error} if error else {}), **kept}
        if error:
            failed.append(name)
        log(f"{name}: {'ok' if not error else 'FAILED'} in {seconds:.1f} s" + (f": {error[:1500]}" if error else ""))
        meta["seconds"] = round(time.monotonic() - t_start, 1)
        (out / "bench.json").write_text(json.dumps(bench, indent=1, default=str))
    summary(bench, a.selected)
    log(f"figures: {out / 'bench.json'}; " + (f"FAILED stage(s): {', '.join(failed)}" if failed else
                                               f"every stage ran, {meta['seconds']:.0f} s in all"))
    return 1 if failed else 0


def summary(bench: dict[str, Any], selected: list[str]) -> None:
    """Seconds per stage, then one line per figure: value, goal, met."""
    print("\nstages: " + ", ".join(f"{n} {s['seconds']:.0f} s (cap {s['cap_s']:.0f})" + ("" if s["ok"] else " FAILED")
                                 for n, s in bench["stages"].items()), flush=True)
    print(f"\n{'figure':36} {'value':>14} {'goal':>10}  met", flush=True)
    for key in [k for s in selected for k in keys_of(s)]:
        f = bench[key]
        v = "-" if f["value"] is None else f"{f['value']:.4g}"
        g = "report" if f["goal"] is None else f"{GOALS[key][2]} {f['goal']:g}"
        met = "-  " + f["reason"] if f["met"] is None else "yes" if f["met"] else "NO"
        print(f"{key:36} {v:>14} {g:>10}  {met}", flush=True)
    print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
