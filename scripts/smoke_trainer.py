"""Trainer probe of the GPU smoke (scripts/gpu_smoke.py runs it in its own process, so a crash or a hung collective
is contained and its memory is freed): FSDP2 at world size WORLD_SIZE (env, set by the caller with RANK, MASTER_ADDR,
MASTER_PORT), one packed step of `--tokens` tokens in one micro-batch, the optimizer step, `named_weights`, a
second step timed warm (the steady rate), and the checkpoint (inflight's own `save_checkpoint`, read back with
transformers).

    python scripts/smoke_trainer.py --model DIR --device cuda --tokens 16384 --out probe.json

Writes a JSON of figures on rank 0; exits non-zero with the failed check in the message.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight.algo.losses import make_loss, merge_stats  # noqa: E402
from inflight.config.algo import AlgoConfig  # noqa: E402
from inflight.config.trainer import TrainerConfig  # noqa: E402
from inflight.contracts import Sample  # noqa: E402
from inflight.trainer.accumulate import StepAccumulator  # noqa: E402
from inflight.trainer.factory import make_trainer  # noqa: E402
from inflight.trainer.loop.checkpoint import CheckpointState, save_checkpoint  # noqa: E402
from inflight.trainer.packing import collate, count_loss_tokens  # noqa: E402


def packed_samples(total: int, vocab: int, seed: int = 0, lengths: tuple[int, int] | None = None,
                   prompt: int = 64) -> list[Sample]:
    """Samples of `lengths` tokens (default 256..1024, 32..128 below 4096 in all; prompt `prompt`) that fill
    `total` tokens exactly; logprobs filled in later."""
    rng = random.Random(seed)
    lo, hi = lengths or ((256, 1024) if total >= 4096 else (32, 128))
    out, left = [], total
    while left > 0:
        n = min(left, rng.randint(lo, hi))
        p = min(prompt, n // 4)
        ids = [rng.randrange(4, vocab) for _ in range(n)]
        out.append(Sample(group_id=f"g{len(out) // 4}", prompt_ids=ids[:p], completion_ids=ids[p:],
                          logprobs=[0.0] * (n - p), versions=[0] * (n - p)))
        left -= n
    return out


def behaviour_logprobs(engine, samples: list[Sample]) -> torch.Tensor:
    """Sets each sample's behaviour logprobs to the trainer's own (forward_logprobs of the packed batch: the first
    step's importance ratio must then be 1 up to the no-grad / grad forward difference); returns the packed row's."""
    batch = collate(samples, [0.0] * len(samples), len(samples), count_loss_tokens(samples))
    lp = engine.forward_logprobs(batch).float().cpu()
    k = 0
    for s in samples:
        k += len(s.prompt_ids)
        s.logprobs = lp[k:k + len(s.completion_ids)].tolist()
        k += len(s.completion_ids)
    return lp


def train_step(engine, samples: list[Sample], tokens: int, cuda: bool) -> tuple[dict, float]:
    """One optimizer step on the packed batch (half the samples rewarded): its stats and seconds."""
    acc = StepAccumulator(engine, make_loss(AlgoConfig()), tokens, len(samples), count_loss_tokens(samples),
                          merge=merge_stats)
    t = time.perf_counter()
    acc.add(samples, [1.0 if i % 2 else -1.0 for i in range(len(samples))])
    out = acc.finish()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    cfg = TrainerConfig(backend="fsdp2", device=a.device, precision="bf16-mixed" if cuda else "float32",
                        gradient_checkpointing=cuda, lr=1e-4, micro_batch_tokens=a.tokens, max_grad_norm=1.0)
    t0 = time.perf_counter()
    engine = make_trainer(a.model, cfg)
    engine.init()
    load_s = time.perf_counter() - t0
    rank = getattr(engine, "rank", 0)
    vocab = engine.model.config.vocab_size
    samples = packed_samples(a.tokens, vocab)
    behaviour_logprobs(engine, samples)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = {n: w.detach().float().cpu().clone() for n, w in engine.named_weights()}

    stats, step_s = train_step(engine, samples, a.tokens, cuda)
    changed = {n for n, w in engine.named_weights() if not torch.equal(before[n], w.detach().float().cpu())}
    # the first step pays for kernel selection and the optimizer's state: a second one gives the steady rate
    _, warm_s = train_step(engine, samples, a.tokens, cuda)
    after = {n: w.detach().float().cpu().clone() for n, w in engine.named_weights()}
    tokens = a.tokens * getattr(engine, "world_size", 1)  # every rank trains --tokens
    figures = {
        "world_size": getattr(engine, "world_size", 1), "load_s": load_s, "packed_tokens": a.tokens,
        "micro_batches": stats["micro_batches"], "step_s": step_s, "warm_step_s": warm_s,
        "trainer_tokens_per_s": tokens / warm_s, "first_step_tokens_per_s": tokens / step_s,
        "ratio_mean": stats.get("ratio_mean"), "grad_norm": stats.get("grad_norm"),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "named_weights": len(after), "changed_weights": len(changed),  # by the first step
    }
    root = Path(tempfile.mkdtemp(prefix="smoke-ckpt-"))
    t2 = time.perf_counter()
    if rank == 0:
        state = CheckpointState(step=2, version=2, samples_trained=2 * len(samples), next_group=2)
        path = save_checkpoint(root, "step-2", engine, state)
    else:  # the other ranks join the collectives of save and train_state, as trainer/loop/fsdp_loop.py does
        engine.save("")
        engine.train_state()
    figures["checkpoint_s"] = time.perf_counter() - t2
    if rank == 0:
        from transformers import AutoModelForCausalLM

        saved = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
        figures["checkpoint_max_abs_diff"] = max((saved[n].detach() - after[n]).abs().max().item() for n in after)
        problems = []
        if stats["micro_batches"] != 1:
            problems.append(f"{a.tokens} tokens took {stats['micro_batches']} micro-batches, not one packed step")
        if abs(figures["ratio_mean"] - 1) > (0.05 if cuda else 1e-4):
            problems.append(f"step-1 ratio_mean {figures['ratio_mean']:.5f}: trainer forwards disagree")
        if not figures["grad_norm"] or figures["grad_norm"] != figures["grad_norm"]:
            problems.append(f"grad_norm {figures['grad_norm']}")
        if figures["changed_weights"] < len(after) // 2:
            problems.append(f"the optimizer step changed {figures['changed_weights']} of {len(after)} tensors")
        if set(saved) != set(after) and not set(after) <= set(saved):
            problems.append(f"checkpoint names differ: {sorted(set(after) ^ set(saved))[:5]}")
        if figures["checkpoint_max_abs_diff"] > 0:
            problems.append(f"checkpoint differs from named_weights by {figures['checkpoint_max_abs_diff']}")
        figures["problems"] = problems
        Path(a.out).write_text(json.dumps(figures, indent=1))
        print(json.dumps(figures), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if rank == 0 and figures["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
