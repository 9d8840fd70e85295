"""What a lower-precision generator buys and costs: decode tokens/s of each `generator_precision` beside float32,
the pause of one weight update (which re-derives the bf16 / int8 weights), and the mismatch between the
generator's logprobs and a float32 trainer's on the same tokens.

    .venv/bin/python bench/precision.py [--sizes small,medium] [--batches 32,128] [--new-tokens 64] [--threads 1]

Throughput: tokens per second of this process's CPU time (ratios from one run; the machine is shared). Models are
llama models built from config as in bench/engine.py (random init).
Mismatch: the generator samples (temperature 1) continuations of the task's prompts; the trainer's logprobs of the
same tokens come from the HF model in float32 (what SingleDeviceTrainer computes). Reported per token: mean
|logprob_gen - logprob_trainer|, and KL(generator || trainer) estimated from the samples with k1 = E[log mu - log
pi] (unbiased, can be negative) and k3 = E[r - 1 - log r], r = pi / mu (unbiased, >= 0, lower variance). The model
is --mismatch-model (default: the trained arith demo model runs/models/tiny if present) since random weights give
near-uniform distributions and hide the mismatch.

Kernel choice for int8 (measured 2026-11-29, 1 thread, microbenchmark of one linear y = x W^T, fp32 = 1.0x):
fbgemm dynamic int8 (torch.ops.quantized.linear_dynamic) 0.19-0.41x the fp32 time; torchao 0.18
Int8WeightOnlyConfig 1.06-1.8x; int8 weight + dequantise + matmul 1.0-1.75x; torch._weight_int8pack_mm 30x
(fp32 input) / 1.1-1.3x (bf16 input); plain bf16 F.linear 0.3-0.52x. Shapes N x K = 768x256 .. 8192x1024, M = 32, 128.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import SIZES, build, prompts, timed  # noqa: E402  (bench/engine.py: same models, same prompts)

from inflight.engine.core import InferenceEngine  # noqa: E402
from inflight.engine.model.precision import PRECISIONS  # noqa: E402
from inflight.engine.model.sampling import SamplingParams  # noqa: E402

SIZES.setdefault("medium", (512, 8, 8, 4, 1536, 4096))


def throughput(path: Path, precision: str, batches: list[int], new: int, vocab: int) -> tuple[dict, float]:
    """({batch: tokens per CPU second}, seconds paused by one full weight update)."""
    eng = InferenceEngine(str(path), max_batch=max(batches), max_model_len=16 + new + 1,
                          generator_precision=precision)
    eng.start()
    sp = SamplingParams(max_tokens=new, ignore_eos=True)

    async def one(rid: str, p: list[int]) -> int:
        return sum([e.token_id >= 0 async for e in eng.generate(rid, p, sp)])

    def run(b: int) -> int:
        async def go() -> int:
            return sum(await asyncio.gather(*[one(f"{b}-{i}", p) for i, p in enumerate(prompts(b, vocab))]))
        return asyncio.run(go())

    try:
        run(4)  # warm-up
        rates = {}
        for b in batches:
            n, cpu, _ = timed(lambda: run(b))
            rates[b] = n / cpu
        new_w = {n: p.detach().clone() * 1.001 for n, p in eng.model.named_parameters()}
        pauses = []
        for _ in range(3):
            t0 = time.perf_counter()
            asyncio.run(eng.run_paused(lambda: eng.load_weights(new_w, eng.version + 1)))
            pauses.append(time.perf_counter() - t0)
    finally:
        eng.stop()
    return rates, min(pauses)


def task_prompts(path: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    pairs = torch.randint(10, 100, (n, 2), generator=g).tolist()
    texts = [f"{a}+{b}=" for a, b in pairs]
    if tok.chat_template:
        return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                        return_dict=False) for t in texts]
    return [tok(t)["input_ids"] for t in texts]


def mismatch(path: Path, precision: str, ps: list[list[int]], new: int) -> tuple[float, float, float, int]:
    """(mean |dlogprob|, KL k1, KL k3, tokens) of the generator at `precision` vs a float32 HF forward."""
    from transformers import AutoModelForCausalLM

    eng = InferenceEngine(str(path), max_batch=len(ps), max_model_len=max(map(len, ps)) + new + 1,
                          generator_precision=precision)
    eng.start()

    async def one(i: int, p: list[int]) -> tuple[list[int], list[float]]:
        evs = [e async for e in eng.generate(f"m{i}", p, SamplingParams(max_tokens=new, seed=i))]
        evs = [e for e in evs if e.token_id >= 0]
        return [e.token_id for e in evs], [e.logprob for e in evs]

    async def go():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(ps)])

    try:
        outs = asyncio.run(go())
    finally:
        eng.stop()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    d_all = []
    with torch.inference_mode():
        for p, (toks, mu) in zip(ps, outs):
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + toks])).logits[0].float(), -1)
            pi = logp[len(p) - 1 : len(p) - 1 + len(toks)].gather(1, torch.tensor(toks)[:, None])[:, 0]
            d_all.append(torch.tensor(mu, dtype=torch.float64) - pi.double())  # log mu - log pi
    d = torch.cat(d_all)
    k3 = (torch.exp(-d) - 1 + d).mean()
    return float(d.abs().mean()), float(d.mean()), float(k3), d.numel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mismatch-model", default="runs/models/tiny")
    ap.add_argument("--mismatch-prompts", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in [s for s in args.sizes.split(",") if s]:  # --sizes "": the mismatch only
            path, n_params = build(Path(tmp) / size, size)
            for prec in PRECISIONS:
                rates, pause = throughput(path, prec, batches, args.new_tokens, SIZES[size][-1])
                rows.append((f"{size} ({n_params / 1e6:.1f}M)", prec, rates, pause))
                print(rows[-1], flush=True)
    mm = []
    mpath = Path(args.mismatch_model)
    if mpath.exists():
        ps = task_prompts(mpath, args.mismatch_prompts)
        for prec in PRECISIONS:
            mm.append((prec, *mismatch(mpath, prec, ps, 16)))
            print(mm[-1], flush=True)
    print(f"\ndecode tokens per CPU second, {args.new_tokens} new tokens, {args.threads} thread(s); "
          "ratio to float32 of the same run")
    print("| model | precision | " + " | ".join(f"batch {b}" for b in batches) + " | pause per update |")
    print("|---|---|" + "---|" * len(batches) + "---|")
    base = {}
    for name, prec, rates, pause in rows:
        if prec == "float32":
            base = rates
        cells = " | ".join(f"{rates[b]:.0f} ({rates[b] / base[b]:.2f}x)" for b in batches)
        print(f"| {name} | {prec} | {cells} | {pause * 1e3:.1f} ms |")
    if mm:
        print(f"\nmismatch vs float32 trainer on the generator's own samples ({mpath}, temperature 1, "
              f"{args.mismatch_prompts} prompts x 16 tokens)")
        print("| precision | tokens | mean abs dlogprob | KL k1 | KL k3 |")
        print("|---|---|---|---|---|")
        for prec, mad, k1, k3, n in mm:
            print(f"| {prec} | {n} | {mad:.2e} | {k1:.2e} | {k3:.2e} |")


if __name__ == "__main__":
    main()
