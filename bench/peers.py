"""inflight against the RL tool people use today, on this machine, in one invocation: TRL's `GRPOTrainer` (own venv
under .cache/peers/trl, never a dependency of inflight) vs `inflight train` pipelined (configs/cpu-demo.yaml) and
sync (configs/cpu-sync.yaml), same warm-started tiny model, arith task, verifier, 16 prompts x 8 samples per step,
lr 3e-4 (--lr), 12 new tokens. The systems run alternately (A B C A B C) to cancel drift; the table gives medians
and the spread (min-max) over the repeats. Repeat r runs every system with seed r (prompt order and sampling), so
the spread holds each system's own learning noise. Every run's steps and evaluations go to RUN_DIR/peers-results.json.

    .venv/bin/python bench/peers.py --setup                # builds the TRL venv and the warm model if missing
    .venv/bin/python bench/peers.py --minutes 3 --repeats 2 --target 0.45
    .venv/bin/python bench/peers.py --setup --size small --model .cache/peers/models/warm-small   # 6.4M model
    .venv/bin/python bench/peers.py --preset smollm2 --setup      # TRL venv + SmolLM2-135M-Instruct (get-model)
    .venv/bin/python bench/peers.py --preset smollm2 --minutes 6 --repeats 1 --systems trl,pipelined --target 0.35

`--preset smollm2` runs the real pretrained model instead, each system as configs/cpu-smollm2.yaml sets inflight:
4 prompts x 8 samples per step, 24 new tokens, temperature 0.7, lr 2e-5, the calculator system prompt through the
model's chat template, last-number answers, 100 held-out problems (bench/peers/arith_eval.py PRESETS).
`--preset smollm2-lora` trains a LoRA adapter in both (rank 8, alpha 16, every linear layer but the head; TRL through
PEFT), lr 2e-4 constant: `make demo-real`'s recipe. FLOPs then still count 6 N per trained token (an upper bound:
the base's weight gradients are skipped in both).

A system is `trl`, `pipelined` or `sync`, optionally with settings after colons: `trl:2` runs TRL on 2 torch
threads (default --trl-threads), `pipelined:actor.max_lag=2` adds that override to inflight's command line.

Per run: samples/s (samples trained by the last optimizer step / its time on the clock below; the like-for-like
figure), seconds and samples to the first held-out evaluation >= --target (clock from the moment generation can
start: inflight's `roles_started`, TRL's `on_train_begin`), accuracy at the largest sample count every system
reached and the mean of the evaluations up to it (the learning curve per sample, steadier than one evaluation), the
share of training completions cut off by the new-token limit over the last quarter of the run (a policy that learnt
not to stop shows there; inflight: `truncated_frac` of its steps, TRL: its `completions/clipped_ratio`), and the
FLOPs each system executed, per sample and as a share of the machine's matmul peak (torch.mm FLOP/s measured here on
all cores, 1024^3 fp32, best of 5, before and after). Executed FLOPs count 2 N per token a forward pass runs over
and 6 N per token of a training forward + backward (N = parameters; attention's own FLOPs, ~2% here, left out):
  inflight: generation runs a group's prompt once (n=G requests share its prefill) and one forward per completion
            token but the last: P + sum(C_i - 1) per group; the trainer runs a group's prompt once per micro-batch
            and skips zero-advantage samples (its `trainer_tokens`);
  TRL:      HF `generate` on the left-padded batch of B samples (128; 32 with smollm2): B x (P_max + C_max - 1)
            tokens; training on the same padded batch: B x (P_max + C_max), C_max from its logged max_length.

Evaluation: every 10 steps, greedy on the same 200 held-out problems with HF `generate`
(bench/peers/arith_eval.py), off the clock for both: TRL evaluates in its loop and subtracts the seconds; inflight
saves a checkpoint every 10 steps (its ~20 ms saves stay on its clock) and the checkpoints are scored after the run.
`--inflight-eval servers` has inflight evaluate through its own servers while it trains instead, as before: the
same scoring, but its 200 requests then share the servers' CPU with the rollouts, on inflight's clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "peers"
TRL_PY = CACHE / "trl" / "bin" / "python"
PY = sys.executable
HERE = Path(__file__).resolve().parent / "peers"
sys.path.insert(0, str(HERE))
from arith_eval import PRESETS, arith_task  # noqa: E402

# ---- setup ----------------------------------------------------------------------------------------------------

def sh(cmd: list[str], **kw) -> None:
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, **kw)


def setup_trl() -> None:
    """TRL in its own venv on the local CPU torch wheel (any other torch would download a CUDA build)."""
    import torch
    import transformers

    pip = [str(TRL_PY), "-m", "pip", "install", "-q"]
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    if TRL_PY.exists():
        if subprocess.run([str(TRL_PY), "-c", "import peft"], capture_output=True).returncode:  # older venvs
            sh(pip + ["peft", torch_pin])
        return
    sh(["python3", "-m", "venv", str(CACHE / "trl")])
    sh(pip + [torch_pin])
    sh(pip + ["trl", "peft", f"transformers=={transformers.__version__}", "pydantic", "httpx",  # inflight.tasks
              torch_pin])  # imports pydantic; peft: the smollm2-lora preset


def setup_model(model: Path, size: str = "tiny") -> None:
    """The demo's warm start: a random model (the demo's tiny one by default), SFT to 30% held-out greedy accuracy
    on the short prompt."""
    if (model / "config.json").exists():
        return
    base = model.parent / (model.name + "-base")
    inflight = str(Path(PY).parent / "inflight")
    if not (base / "config.json").exists():
        sh([inflight, "make-model", "--task", "arith", "--size", size, str(base)])
    sh([inflight, "sft", "--task", "arith", "--model", str(base), "--out", str(model), "--wrong-frac", "0",
        "--target-acc", "0.3", "--micro-batch-tokens", "4096", "trainer.threads=1", 'task.prompt="{expr}="'])


# ---- machine --------------------------------------------------------------------------------------------------

def mm_peak(threads: int, n: int = 1024, reps: int = 5) -> float:
    """Best FLOP/s of an n^3 fp32 torch.mm on `threads` threads."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    torch.set_num_threads(old)
    return best


def machine() -> str:
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    trl = subprocess.run([str(TRL_PY), "-c", "import trl, torch, transformers; print(trl.__version__, "
                          "torch.__version__, transformers.__version__)"], capture_output=True,
                         text=True).stdout if TRL_PY.exists() else ""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    return (f"machine: {cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; python "
            f"{platform.python_version()}; inflight venv: torch {torch.__version__}, transformers "
            f"{transformers.__version__}; TRL venv (trl torch transformers): {trl.strip() or 'absent'}; "
            f"inflight commit {commit.strip()} (+ working tree)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- runs -----------------------------------------------------------------------------------------------------

def hf_accuracies(models: list[Path], preset: str) -> list[float]:
    """arith_eval.py's held-out accuracy of each saved model, in one process."""
    out = subprocess.run([PY, str(HERE / "arith_eval.py"), "--preset", preset, *map(str, models)],
                         capture_output=True, text=True, check=True)
    return [float(line) for line in out.stdout.split()]


def run_inflight(mode: str, model: Path, minutes: float, tag: str, max_steps: int, eval_every: int,
                 run_dir: Path, extra: list[str], lr: float, eval_on: str, seed: int, preset: str) -> dict:
    """eval_on "checkpoints": a checkpoint every eval_every steps, scored afterwards with arith_eval.py (TRL's
    function; like TRL's, off the clock); "servers": inflight's own evaluation through its servers while it trains
    (the same greedy scoring, but its 200 requests share the servers' CPU with the rollouts, on the clock)."""
    p = PRESETS[preset]
    config = {"pipelined": p["config"], "sync": p["sync_config"]}[mode]
    if mode == "sync" and p["sync_config"] == p["config"]:
        extra = ["pipeline.mode=sync", *extra]
    name = f"peers-{mode}-{tag}" + "".join(f"-{e.replace('=', '')}" for e in extra)
    evaluation = ([f"actor.eval_every={eval_every}"] if eval_on == "servers" else
                  ["actor.eval_every=0", f"pipeline.checkpoint_every={eval_every}", "pipeline.keep_checkpoints=100000"])
    cmd = [str(Path(PY).parent / "inflight"), "train", config, f"model.path={model}", f"name={name}",
           f"pipeline.run_dir={run_dir}", f"pipeline.max_minutes={minutes}", f"pipeline.max_steps={max_steps}",
           *p["task_overrides"], *evaluation, "pipeline.progress=false", f"trainer.lr={lr}", f"seed={seed}",
           "pipeline.tensorboard=false",
           f"server.base_port={free_port()}", f"pipeline.weight_sync_port={free_port()}", *extra]
    sh(cmd, stdout=subprocess.DEVNULL)
    recs = [json.loads(line) for line in open(run_dir / name / "metrics.jsonl")]
    t0 = next(r["time"] for r in recs if r.get("event") == "roles_started")
    train = [r for r in recs if r.get("event") == "train_step"]
    # (time, samples trained, tokens generated through a forward, tokens trained through forward+backward, cut off)
    steps = [(r["time"] - t0, r["samples_total"], r["prompt_tokens"] + r["completion_tokens"] - r["samples"],
              r["trainer_tokens"], r["truncated_frac"]) for r in train]
    ckpts = run_dir / name / "checkpoints"
    if eval_on == "servers":
        evals = []
        for r in recs:
            if r.get("event") == "eval" and r.get("accuracy") is not None:
                done = [s for t, s, *_ in steps if t <= r["time"] - t0]
                evals.append((r["time"] - t0, done[-1] if done else 0, float(r["accuracy"])))
        (final_hf,) = hf_accuracies([ckpts / "final"], preset)
    else:
        at = {r["step"]: (r["time"] - t0, r["samples_total"]) for r in train}
        saved = sorted((step, p) for p in ckpts.glob("step_*") if (step := int(p.name.split("_")[1])) in at)
        # the warm start (step 0), every saved step and the final checkpoint, in one process
        *accs, final_hf = hf_accuracies([model, *(c for _, c in saved), ckpts / "final"], preset)
        evals = [(0.0, 0, accs[0])] + [(*at[k], a) for (k, _), a in zip(saved, accs[1:])]
        for _, c in saved:  # the final checkpoint stays
            shutil.rmtree(c)
    return {"steps": steps, "evals": evals, "final_hf": final_hf, "cmd": shlex.join(cmd)}


def run_trl(model: Path, minutes: float, tag: str, max_steps: int, eval_every: int, run_dir: Path,
            threads: int, lr: float, seed: int, prompt_max: int, preset: str) -> dict:
    out = run_dir / f"peers-trl{threads}-{tag}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(TRL_PY), str(HERE / "trl_grpo.py"), "--model", str(model), "--out", str(out), "--minutes",
           str(minutes), "--max-steps", str(max_steps), "--threads", str(threads), "--eval-every", str(eval_every),
           "--lr", str(lr), "--seed", str(seed), "--preset", preset]
    sh(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(threads),
                                                                        "TOKENIZERS_PARALLELISM": "false"})
    recs = [json.loads(line) for line in open(out)]
    logs = [r for r in recs if r["event"] == "log" and r.get("max_length") is not None]

    def covering(step: int) -> dict:
        """The log whose window (the logging_steps before it) holds this step; past the last, the last one."""
        return next((g for g in logs if g["step"] >= step),
                    logs[-1] if logs else {"max_length": float(PRESETS[preset]["max_new_tokens"])})

    steps = []
    for r in (r for r in recs if r["event"] == "step"):
        g, b = covering(r["step"]), PRESETS[preset]["prompts_per_step"] * PRESETS[preset]["group_size"]
        width = prompt_max + g["max_length"]  # the padded batch generate and the training pass run over
        steps.append((r["time"], r["samples"], b * (width - 1), b * width, g.get("clipped_ratio")))
    evals = [(r["time"], r["samples"], r["accuracy"]) for r in recs if r["event"] == "eval"]
    return {"steps": steps, "evals": evals, "final_hf": evals[-1][2] if evals else None, "cmd": shlex.join(cmd)}


def summarise(run: dict, target: float, n_params: int, peak: float) -> dict:
    steps, evals = run["steps"], run["evals"]
    t_b, s_b = steps[-1][:2]
    # from the start, not from the first step: sync mode trains in bursts of num_grad_steps after each round
    rate = s_b / max(t_b, 1e-9)
    flops = sum(2.0 * n_params * gen + 6.0 * n_params * train for _, _, gen, train, _ in steps)
    late = [c for *_, c in steps[-max(1, len(steps) // 4):] if c is not None]
    hit = next(((t, s) for t, s, a in evals if a >= target), None)
    return {"samples_per_s": rate, "samples": s_b, "wall_s": t_b, "to_target_s": hit[0] if hit else None,
            "to_target_samples": hit[1] if hit else None, "first_acc": evals[0][2] if evals else None,
            "best_acc": max(a for _, _, a in evals) if evals else None, "final_hf": run["final_hf"],
            "flops_per_sample": flops / max(s_b, 1), "mfu": flops / max(t_b, 1e-9) / peak,
            "truncated_late": statistics.mean(late) if late else None, "evals": evals}


def acc_at(evals: list, samples: float) -> float | None:
    """The last evaluation taken at or before `samples` trained samples."""
    done = [a for _, s, a in evals if s <= samples]
    return done[-1] if done else None


def mean_acc_to(evals: list, samples: float) -> float | None:
    """The learning curve's mean: the average of the evaluations after the start, up to `samples` trained samples
    (one evaluation has ±3 points of noise on 200 problems; the mean of many compares runs more steadily)."""
    accs = [a for _, s, a in evals if 0 < s <= samples]
    return statistics.mean(accs) if accs else None


def fmt(vals: list, spec: str, scale: float = 1.0, unit: str = "") -> str:
    vals = [v * scale for v in vals if v is not None]
    if not vals:
        return "not reached"
    med = statistics.median(vals)
    return f"{med:{spec}}{unit}" + (f" ({min(vals):{spec}}-{max(vals):{spec}})" if len(vals) > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                    help="model, task and settings (bench/peers/arith_eval.py PRESETS)")
    ap.add_argument("--model", type=Path, default=None, help="default: the preset's model")
    ap.add_argument("--minutes", type=float, default=3.0, help="training wall minutes per run")
    ap.add_argument("--max-steps", type=int, default=0, help="also stop each run after this many steps (0 = none)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--systems", default="trl,pipelined,sync")
    ap.add_argument("--target", type=float, default=0.45, help="held-out accuracy to reach")
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate of every system (constant, AdamW); default: the preset's")
    ap.add_argument("--eval-every", type=int, default=10, help="optimizer steps between held-out evaluations")
    ap.add_argument("--inflight-eval", choices=("checkpoints", "servers"), default="checkpoints",
                    help="score inflight from checkpoints afterwards with TRL's function, off the clock as TRL's is "
                         "(default), or through its servers while it trains, on the clock")
    ap.add_argument("--trl-threads", type=int, default=1,
                    help="torch threads of TRL's one process (inflight: 1 per server + 1 trainer); on a shared, "
                         "oversubscribed machine 2 threads made TRL 16x slower (OpenMP barriers)")
    ap.add_argument("--run-dir", type=Path, default=CACHE / "runs")
    ap.add_argument("--setup", action="store_true", help="build the TRL venv and the warm model if missing, then exit")
    ap.add_argument("--size", default="tiny", help="with --setup: the model size to build (inflight make-model)")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    args.model = args.model or REPO / preset["model"]
    args.lr = args.lr if args.lr is not None else preset["lr"]
    if args.setup:
        setup_trl()
        if args.preset.startswith("smollm2"):
            sh([str(Path(PY).parent / "inflight"), "get-model", "smollm2-135m-instruct", str(args.model)])
        else:
            setup_model(args.model, args.size)
        return
    systems = args.systems.split(",")
    if any(s.split(":")[0] not in ("trl", "pipelined", "sync") for s in systems):
        sys.exit(f"--systems: each one is trl, pipelined or sync (with :settings), not {args.systems!r}")
    if any(s.startswith("trl") for s in systems) and not TRL_PY.exists():
        sys.exit(f"TRL venv missing at {TRL_PY}: run `{PY} bench/peers.py --setup` first")
    if not (args.model / "config.json").exists():
        sys.exit(f"model {args.model} missing: run `{PY} bench/peers.py --setup` first")
    print(machine())
    print("command:", shlex.join([Path(PY).name, *sys.argv]), flush=True)

    from transformers import AutoConfig, AutoTokenizer

    tok, task = AutoTokenizer.from_pretrained(args.model), arith_task(args.preset)
    prompt_lens = [len(tok.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for s in task.eval_samples()]
    from safetensors import safe_open

    with safe_open(str(args.model / "model.safetensors"), "pt") as f:
        n_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())  # tied: the lm_head counted once
    AutoConfig.from_pretrained(args.model)  # fails early on a broken folder
    peaks = [mm_peak(os.cpu_count() or 1)]
    max_steps = args.max_steps or 1_000_000
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    cmds = {}
    for r in range(args.repeats):
        for system in systems:  # A B C A B C: every system sees the same drift of the machine's load
            tag = f"r{r}"
            kind, *extra = system.split(":")
            res = (run_trl(args.model, args.minutes, tag, max_steps, args.eval_every, args.run_dir,
                           int(extra[0]) if extra else args.trl_threads, args.lr, seed=r, prompt_max=max(prompt_lens),
                           preset=args.preset)
                   if kind == "trl" else
                   run_inflight(kind, args.model, args.minutes, tag, max_steps, args.eval_every, args.run_dir, extra,
                                args.lr, args.inflight_eval, seed=r, preset=args.preset))
            cmds[system] = res["cmd"]
            runs[system].append(res)
            print(f"  {system} {tag}: {len(res['steps'])} steps, evals {[round(a, 3) for *_, a in res['evals']]}",
                  flush=True)
    peaks.append(mm_peak(os.cpu_count() or 1))
    peak = statistics.median(peaks)
    table = {s: [summarise(x, args.target, n_params, peak) for x in runs[s]] for s in systems}
    common = min(x["samples"] for rs in table.values() for x in rs)
    print(f"\nparameters {n_params:,}; prompts {statistics.mean(prompt_lens):.1f} tokens (max {max(prompt_lens)}); "
          f"torch.mm peak "
          f"{peak / 1e9:.1f} GFLOP/s (runs: {', '.join(f'{p / 1e9:.1f}' for p in peaks)}); target accuracy "
          f"{args.target:.0%}; {args.repeats} repeat(s) x {args.minutes} min; median (min-max)")
    head = ["system", "samples/s", "vs TRL", "samples trained", f"s to {args.target:.0%}",
            f"samples to {args.target:.0%}", "acc at start", f"acc at {common} samples",
            f"mean acc to {common} samples", "best acc", "final acc (HF eval)", "cut off (last quarter)",
            "executed MFLOP/sample", "matmul peak share (executed)"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    trls = [s for s in table if s.startswith("trl")]  # the baseline: the fastest TRL setting that ran
    trl_rate = max(statistics.median(x["samples_per_s"] for x in table[s]) for s in trls) if trls else None
    for s, rs in table.items():
        rate = [x["samples_per_s"] for x in rs]
        ratio = fmt([v / trl_rate for v in rate], ".2f") + "x" if trl_rate else "-"
        cells = [s, fmt(rate, ".1f"), ratio, fmt([x["samples"] for x in rs], ".0f"),
                 fmt([x["to_target_s"] for x in rs], ".0f"), fmt([x["to_target_samples"] for x in rs], ".0f"),
                 fmt([x["first_acc"] for x in rs], ".1f", 100),
                 fmt([acc_at(x["evals"], common) for x in rs], ".1f", 100),
                 fmt([mean_acc_to(x["evals"], common) for x in rs], ".1f", 100),
                 fmt([x["best_acc"] for x in rs], ".1f", 100), fmt([x["final_hf"] for x in rs], ".1f", 100),
                 fmt([x["truncated_late"] for x in rs], ".1f", 100, "%"),
                 fmt([x["flops_per_sample"] for x in rs], ".1f", 1e-6),
                 fmt([x["mfu"] for x in rs], ".2f", 100, "%")]
        print("| " + " | ".join(cells) + " |")
    print("\ncommands:")
    for s, c in cmds.items():
        print(f"  {s}: {c}")
    out = args.run_dir / "peers-results.json"  # every run's steps and evaluations, for a closer look
    out.write_text(json.dumps({"argv": sys.argv, "common_samples": common, "runs": runs, "table": table}))
    print(f"runs and evaluations: {out}")


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


if __name__ == "__main__":
    main()
