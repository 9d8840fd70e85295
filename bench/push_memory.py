"""Rank 0's extra host memory for one FSDP2 weight push (not a test): the Qwen2.5-0.5B shape (494M parameters,
tied embeddings, random weights from the config), 2 gloo ranks on CPU, one `inflight serve` in bfloat16.

    .venv/bin/python bench/push_memory.py [--code DIR] [--bucket-mb 16] [--out runs/bench-push-memory]

Each rank is a process of this script; both push through DistributedTrainerLoop's own path (`_send_weights`, the
gather on every rank, rank 0's send). `--code DIR`: the folder whose `inflight` package the ranks import (e.g. an
older revision unpacked with `git archive REV inflight | tar -x -C DIR`), to compare revisions. Rank 0's figure:
its peak resident memory during the push (VmHWM, reset first through /proc/self/clear_refs) minus its resident
memory just before it, and what it still holds after it. glibc returns large blocks at once
(MALLOC_MMAP_THRESHOLD_ fixed), so memory freed before the push is not counted as reused. Reference: the model in
bfloat16 (one wire copy) and in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=32768)


def status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def build_model(out: Path) -> Path:
    """Tokenizer from `make_model` (as scripts/gpu_smoke.py builds it), weights of the Qwen2.5-0.5B shape (Llama
    modules with Qwen2's sizes, q/k/v biases), tied, bfloat16 on disk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from inflight.config.tasks import TaskConfig
    from inflight.modelkit.build import make_model

    d = out / "qwen05-shape"
    if (d / "done.json").exists():
        return d
    make_model(TaskConfig(name="arith"), d, size="micro", max_positions=4096)
    tok = LlamaConfig.from_pretrained(d)
    for f in [*d.glob("*.safetensors"), d / "inflight_model.json"]:
        f.unlink()
    cfg = LlamaConfig(**QWEN05, attention_bias=True, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(d)
    (d / "done.json").write_text(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
    return d


def rank_main(model: str, url: str, bucket_mb: float, out: str) -> None:
    import gc

    import torch

    from inflight.config import RunConfig
    from inflight.config.trainer import TrainerConfig
    from inflight.report.metrics import MetricsLogger
    from inflight.trainer.fsdp import FSDP2Trainer
    from inflight.trainer.loop.fsdp_loop import DistributedTrainerLoop
    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    t = FSDP2Trainer(model, TrainerConfig(backend="fsdp2", threads=1))
    t.init()
    sync = None
    if t.rank == 0:
        sync = WeightSyncClient([url], dtype="bfloat16", bucket_bytes=int(bucket_mb * 2**20), timeout_s=600.0)
        sync.init_process_group()
    run = Path(out).parent / "run"
    loop = DistributedTrainerLoop(RunConfig(), t, None, sync, MetricsLogger(run, "trainer") if t.rank == 0 else None,
                                  run, rank=t.rank, world_size=t.world_size)
    gc.collect()
    torch.distributed.barrier(group=t.cpu_group)
    before = status_kb("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    loop._send_weights(1)
    seconds = time.perf_counter() - t0
    peak = status_kb("VmHWM")
    gc.collect()
    after = status_kb("VmRSS")
    params = sum(p.numel() for p in t.model.parameters())
    if t.rank == 0:
        Path(out).write_text(json.dumps({"before_mb": before / 1024, "peak_extra_mb": (peak - before) / 1024,
                                         "held_after_mb": (after - before) / 1024, "push_s": seconds,
                                         "parameters": params}))
    torch.distributed.barrier(group=t.cpu_group)
    if sync is not None:
        sync.close()
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--code", default=str(ROOT), help="folder holding the `inflight` package the ranks run")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-push-memory"))
    ap.add_argument("--rank-worker", nargs=4, metavar=("MODEL", "URL", "BUCKET_MB", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        model, url, bucket_mb, out = args.rank_worker
        return rank_main(model, url, float(bucket_mb), out)
    sys.path.insert(0, str(ROOT))
    from inflight.engine.serve import ServerProcess
    from inflight.process import free_port

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(out)
    n = json.loads((model / "done.json").read_text())["parameters"]
    result = out / "rank0.json"
    result.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(args.code), OMP_NUM_THREADS="1", WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    with ServerProcess(str(model), extra_args=["--dtype", "bfloat16", "--threads", "1", "--max-model-len", "256"],
                       startup_timeout_s=600) as server:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-worker", str(model), server.url,
                                   str(args.bucket_mb), str(result)],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
        codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")
    got = json.loads(result.read_text())
    print(f"\nrank 0 of 2, one push of the Qwen2.5-0.5B shape ({n / 1e6:.0f}M parameters; "
          f"bf16 {2 * n / 2**20:.0f} MiB, fp32 {4 * n / 2**20:.0f} MiB), bucket {args.bucket_mb:g} MiB, "
          f"code {args.code}")
    print("| RSS before (MiB) | peak extra during the push (MiB) | still held after (MiB) | push (s) |")
    print("|---|---|---|---|")
    print(f"| {got['before_mb']:.0f} | {got['peak_extra_mb']:.0f} | {got['held_after_mb']:.0f} | {got['push_s']:.1f} |")


if __name__ == "__main__":
    main()
