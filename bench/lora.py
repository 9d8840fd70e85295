"""LoRA (trainer.lora) against full fine-tuning: what a push costs, and what the trainer holds (not a test).

    .venv/bin/python bench/lora.py [--model .cache/models/smollm2-135m-instruct] [--ranks 1,8,32] [--pushes 3]
        [--transports per_tensor,shm] [--steps 3] [--skip-push] [--skip-step]

Pushes. One built-in server (`inflight serve`) on the model, with a streaming generation in flight
(bench/weight_sync.py's VersionWatcher). This process is the trainer: for each rank a SingleDeviceTrainer with
trainer.lora (all-linear; B filled with small random values, as after training) pushes `named_weights()` with
`adapter` over each transport; the full update is the model's own weights, perturbed. In turn, `--pushes` times each,
`--gap-s` apart: bytes, push seconds (announce + transfer + the server's answer), the server's own paused seconds
(its answer's pause_s), and until generating (the first streamed token of the new version).

Trainer. One child process per configuration (full, and LoRA at each rank) takes `--steps` optimizer steps on the
same packed micro-batch (`--samples` samples of `--tokens` tokens, a REINFORCE loss): median step seconds, resident
memory after init and at its peak (ru_maxrss: torch's allocations are not seen by tracemalloc), trainable
parameters, and the optimizer state's bytes (AdamW's two moments). 1 torch thread everywhere.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight.config.trainer import LoraConfig, TrainerConfig  # noqa: E402
from inflight.trainer.single import SingleDeviceTrainer  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "models" / "smollm2-135m-instruct"
TRANSPORTS = ("per_tensor", "bucketed", "shm", "file")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def lora_trainer(model: str, rank: int) -> SingleDeviceTrainer:
    t = SingleDeviceTrainer(model, TrainerConfig(threads=1, lora=LoraConfig(rank=rank, alpha=2.0 * rank)))
    t.init()
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # a trained adapter's B is not 0 (the values do not change the cost)
        for n, p in t.model.named_parameters():
            if ".lora_B." in n:
                p.copy_(1e-3 * torch.randn(p.shape, generator=g))
    return t


# ---- pushes --------------------------------------------------------------------------------------------------
def bench_pushes(args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from bench.weight_sync import VersionWatcher
    from inflight.engine.serve import ServerProcess
    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    ranks = [int(r) for r in args.ranks.split(",")]
    updates: dict[str, tuple[list, dict | None]] = {}
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    updates["full"] = ([(n, p.detach() + 0.001 * torch.randn(p.shape, generator=g))
                        for n, p in base.named_parameters()], None)
    del base
    for r in ranks:
        t = lora_trainer(args.model, r)
        updates[f"LoRA rank {r}"] = ([(n, x.clone()) for n, x in t.named_weights()], t.adapter)
        del t
    transports = [x for x in args.transports.split(",") if x]
    rows = []
    with ServerProcess(args.model, extra_args=["--max-model-len", "512", "--threads", "1"],
                       env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=600) as srv:
        model_id = __import__("httpx").get(srv.url + "/v1/models").json()["data"][0]["id"]
        watcher = VersionWatcher(srv.url, model_id)
        clients = {}
        try:
            if {"per_tensor", "bucketed"} & set(transports):
                clients["per_tensor"] = clients["bucketed"] = WeightSyncClient([srv.url], timeout_s=300)
                clients["per_tensor"].init_process_group()
            for x in {"file", "shm"} & set(transports):
                clients[x] = WeightSyncClient([srv.url], transport=x, timeout_s=300)
            version = 0
            for _ in range(args.pushes):
                for what, (tensors, adapter) in updates.items():
                    for transport in transports:
                        client = clients[transport]
                        client.bucket_bytes = 16 * 2**20 if transport == "bucketed" else 0
                        version += 1
                        t0 = time.perf_counter()
                        stats = client.push(tensors, version, adapter=adapter)
                        t_push = time.perf_counter() - t0
                        t_gen = watcher.wait_for(version, timeout_s=300) - t0
                        rows.append(dict(update=what, transport=transport, bytes=stats["bytes"], push_s=t_push,
                                         pause_s=max(stats["pause_s"].values()), until_generating_s=t_gen))
                        time.sleep(args.gap_s)
        finally:
            watcher.stop()
            for c in {id(x): x for x in clients.values()}.values():
                c.close()
    return rows


def print_pushes(rows: list[dict]) -> None:
    full = statistics.median(r["bytes"] for r in rows if r["update"] == "full")
    print("\n| update | bytes | fewer bytes than full | transport | push s | server paused ms | until generating s |")
    print("|---|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["update"], r["transport"]) for r in rows):
        sel = [r for r in rows if (r["update"], r["transport"]) == key]

        def med(k: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
            v = [r[k] * scale for r in sel]
            return f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}–{fmt.format(max(v))})"

        nbytes = sel[0]["bytes"]
        print(f"| {key[0]} | {nbytes / 2**20:.2f} MiB | {full / nbytes:.0f}× | {key[1]} | {med('push_s')} | "
              f"{med('pause_s', 1e3, '{:.1f}')} | {med('until_generating_s')} |")


# ---- trainer steps (one child process per configuration: its peak RSS is its own) ---------------------------
def step_child(model: str, rank: int, steps: int, samples: int, tokens: int) -> dict:
    from inflight.contracts import Sample
    from inflight.trainer.packing import pack_samples

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rss0 = rss_mb()
    if rank:
        t = lora_trainer(model, rank)
    else:
        t = SingleDeviceTrainer(model, TrainerConfig(threads=1))
        t.init()
    rss_init = rss_mb()
    g = torch.Generator().manual_seed(1)
    vocab = t.model.config.vocab_size
    batch = [Sample(group_id=f"g{i}", prompt_ids=torch.randint(4, vocab, (16,), generator=g).tolist(),
                    completion_ids=torch.randint(4, vocab, (tokens - 16,), generator=g).tolist(),
                    logprobs=[-1.0] * (tokens - 16), versions=[0] * (tokens - 16)) for i in range(samples)]
    adv = [1.0 if i % 2 else -1.0 for i in range(samples)]

    def loss_fn(lp, mb, ent):
        return -(mb.advantages * lp * mb.loss_mask).sum() / mb.num_samples_in_step, {}

    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for mb in pack_samples(batch, adv, samples * tokens, samples, samples * (tokens - 16)):
            t.backward(mb, loss_fn)
        t.optimizer_step()
        times.append(time.perf_counter() - t0)
    opt_bytes = sum(v.numel() * v.element_size() for s in t.optimizer.state.values() for k, v in s.items()
                    if k != "step")
    return {"config": f"LoRA rank {rank}" if rank else "full", "step_s": statistics.median(times),
            "trainable": sum(p.numel() for p in t.model.parameters() if p.requires_grad),
            "optimizer_bytes": opt_bytes, "rss_start_mb": rss0, "rss_init_mb": rss_init,
            "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def bench_steps(args) -> list[dict]:
    rows = []
    for rank in [0] + [int(r) for r in args.ranks.split(",")]:
        cmd = [sys.executable, __file__, "--model", str(args.model), "--step-child", str(rank), "--steps",
               str(args.steps), "--samples", str(args.samples), "--tokens", str(args.tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1",
                                                                       **__import__("os").environ})
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def print_steps(rows: list[dict], args) -> None:
    full = rows[0]
    print(f"\n{args.samples} samples x {args.tokens} tokens per step, {args.steps} steps (median), 1 thread")
    print("| trainer | trainable params | optimizer state | step s | RSS after init | peak RSS | peak - before load |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['trainable'] / 1e6:.2f}M | {r['optimizer_bytes'] / 2**20:.1f} MiB "
              f"({full['optimizer_bytes'] / max(1, r['optimizer_bytes']):.0f}× less) | {r['step_s']:.2f} | "
              f"{r['rss_init_mb']:.0f} MiB | {r['rss_peak_mb']:.0f} MiB | {r['rss_peak_mb'] - r['rss_start_mb']:.0f} MiB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="an HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--ranks", default="1,8,32")
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--transports", default="per_tensor,shm", help="from " + ", ".join(TRANSPORTS))
    ap.add_argument("--gap-s", type=float, default=1.0, help="seconds between pushes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip-push", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--step-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step_child is not None:
        print(json.dumps(step_child(args.model, args.step_child, args.steps, args.samples, args.tokens)))
        return
    torch.set_num_threads(1)
    print(f"model {args.model}; torch {torch.__version__}")
    if not args.skip_push:
        print_pushes(bench_pushes(args))
    if not args.skip_step:
        print_steps(bench_steps(args), args)


if __name__ == "__main__":
    main()
