"""Trainer stage of the GPU bench (scripts/gpu_bench.py): the run config's trainer (trainer.*: backend, precision,
gradient checkpointing, attention, ...) on the bench's model, one packed step of `--packed-tokens` tokens of ~1k-token
samples. The trainer's logprobs against a float32 forward of the same weights, a cold step, a warm step (the
figures), then a third step under the torch profiler: its table goes to the log, its top operations to the JSON.

Runs in a process of its own (the driver sets RANK=0, WORLD_SIZE=1, MASTER_ADDR/PORT for FSDP2 at world 1).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench_common import PEAKS, Report, bf16_peak, device_sync, log, model_shape, peak_memory_gb, run_config
from smoke_trainer import behaviour_logprobs, packed_samples, train_step


def reference_max_diff(engine: Any, samples: list, lp: Any, model_dir: str, device: str) -> tuple[float, float]:
    """Max and mean |trainer logprob - float32 logprob| over the completion tokens, the reference a float32 HF
    model holding the trainer's weights (named_weights), one sample per forward, float64 log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    weights = dict(engine.named_weights())
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(weights[n].to(p.device, p.dtype))
    del weights
    diffs, k = [], 0
    with torch.no_grad():
        for s in samples:
            ids = s.prompt_ids + s.completion_ids
            logits = ref(torch.tensor([ids], device=device)).logits[0].double()
            want = torch.log_softmax(logits, -1)[torch.arange(len(s.prompt_ids) - 1, len(ids) - 1, device=device),
                                                  torch.tensor(s.completion_ids, device=device)].cpu()
            got = lp[k + len(s.prompt_ids):k + len(ids)].double()
            diffs.append((got - want).abs())
            k += len(ids)
    del ref
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    d = torch.cat(diffs)
    return d.max().item(), d.mean().item()


def profile_step(engine: Any, samples: list, tokens: int, cuda: bool, rows: int = 25,
                 top_n: int = 15) -> list[dict[str, Any]]:
    """One more step under torch.profiler: the table of its top `rows` operations (by self device time on CUDA,
    self CPU time on CPU) printed, the top `top_n` returned."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        train_step(engine, samples, tokens, cuda)
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=rows), flush=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top_n]
    return [{"name": e.key, "calls": e.count, "self_ms": getattr(e, key) / 1e3, "share": getattr(e, key) / total,
             "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in top]


def run(a: Any, rep: Report, models: dict[str, str], out: Path) -> None:
    import torch

    from inflight.trainer.factory import make_trainer
    from inflight.trainer.kernels import varlen

    cuda = a.device.startswith("cuda")
    model = models["tied"]
    shape = model_shape(model)
    cfg = run_config(a, [f"trainer.micro_batch_tokens={a.packed_tokens}"]).trainer
    t0 = time.perf_counter()
    engine = make_trainer(model, cfg)
    engine.init()
    load_s = time.perf_counter() - t0
    samples = packed_samples(a.packed_tokens, shape["vocab"], lengths=a.sample_len, prompt=a.sample_len[0] // 8)
    lp = behaviour_logprobs(engine, samples)
    max_d, mean_d = reference_max_diff(engine, samples, lp, model, a.device)
    rep.figure("trainer_logprob_max_diff", max_d, mean_abs_diff=mean_d, precision=cfg.precision,
               tokens=sum(len(s.completion_ids) for s in samples), reference="float32 HF forward, float64 softmax")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    varlen.CALLS.clear()
    cold, cold_s = train_step(engine, samples, a.packed_tokens, cuda)
    _, warm_s = train_step(engine, samples, a.packed_tokens, cuda)
    peak, what = peak_memory_gb(a.device)
    device_sync(a.device)
    tokens = a.packed_tokens
    lens = [len(s) for s in samples]
    # model FLOPs: 6 N per token (forward + backward of every matmul weight; the recompute of gradient
    # checkpointing not counted) + causal attention: 6 * layers * heads * head_dim * L^2 per sample of length L
    attn = 6 * shape["layers"] * shape["heads"] * shape["head_dim"] * sum(n * n for n in lens)
    flops = 6 * shape["matmul_parameters"] * tokens + attn
    context = {"backend": cfg.backend, "precision": cfg.precision, "gradient_checkpointing":
               cfg.gradient_checkpointing, "checkpointing_on": bool(getattr(engine.model, "is_gradient_checkpointing",
                                                                            False)), "attention": cfg.attention, "packed_tokens": tokens,
               "samples": len(samples), "sample_lengths": [min(lens), max(lens)], "micro_batches":
               cold.get("micro_batches"), "warm_step_s": warm_s, "cold_step_s": cold_s, "load_s": load_s,
               "ratio_mean": cold.get("ratio_mean"),
               # what attention ran: the varlen kernel, or (fallback) the per-length SDPA path
               "attention_impl": engine.model.config._attn_implementation, "varlen_calls": dict(varlen.CALLS)}
    rep.figure("trainer_tokens_per_s", tokens / warm_s, **context)
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    peak_flops = bf16_peak(gpu)
    unjudged = None if peak_flops or not cuda else \
        f"no bf16 peak known for {gpu!r} (bench_common.PEAKS): the value is against the H100 / H200 SXM peak"
    peak_flops = peak_flops or dict(PEAKS)["H100"]
    rep.figure("trainer_mfu", flops / warm_s / peak_flops, unjudged=unjudged, flops_per_step=flops,
               attention_flops=attn, matmul_parameters=shape["matmul_parameters"], peak_flops=peak_flops,
               device_name=gpu, achieved_tflops=flops / warm_s / 1e12, warm_step_s=warm_s)
    rep.figure("trainer_peak_gb", peak, measured_by=what, over="the cold and the warm step")
    log("trainer: profiling a third step")
    t1 = time.perf_counter()
    top = profile_step(engine, samples, a.packed_tokens, cuda)
    rep.data["figures"]["trainer_tokens_per_s"]["context"].update(
        profiled_step_s=time.perf_counter() - t1, profile_top=top)
    rep.write()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
