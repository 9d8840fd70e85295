"""Measures a Profile on this machine (`inflight profile`): the built-in engine's decode step time over batch sizes
and contexts and its prefill tokens/s, the trainer's forward + backward tokens/s and optimizer step, and the pause
of a weight swap; or the step-time curve of any running OpenAI-compatible server (vLLM, SGLang, inflight) timed
over HTTP. Wall-clock time, as the simulator predicts wall-clock time.

A decode step's time is the difference of two runs that differ only in the number of new tokens (n1 < n2, both
with ignore_eos): (T(n2) - T(n1)) / (n2 - n1) removes the prefill and the fixed costs; its context is
prompt + (n1 + n2) / 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import statistics
import time
from typing import Any, Callable, Iterator

import aiohttp
import torch
from transformers import AutoModelForCausalLM

from inflight import backends
from inflight.algo.losses import make_loss
from inflight.config import RunConfig
from inflight.config.algo import AlgoConfig
from inflight.config.trainer import TrainerConfig
from inflight.contracts import Sample
from inflight.engine.core import InferenceEngine
from inflight.engine.model.sampling import SamplingParams
from inflight.engine.serve import ServerProcess
from inflight.process import free_port
from inflight.trainer.factory import make_trainer
from inflight.trainer.packing import count_loss_tokens, pack_samples
from inflight.trainer.weight_sync import make_weight_sync
from inflight_plan.profile import DecodeCurve, EngineProfile, TrainerProfile


def _median(fn, repeats: int) -> float:
    vals = sorted(fn() for _ in range(max(1, repeats)))
    return vals[len(vals) // 2]


def _decode_grid(timer, batches: list[int], contexts: list[int], n1: int, n2: int,
                 repeats: int = 3) -> list[list[float]]:
    """timer(batch, prompt_tokens, new_tokens) -> seconds; rows per context (prompt = context - mean new tokens).
    Each point is the median of `repeats` differences, the two lengths timed in turn: one pair alone moved by
    20-60% between two profiles of one 2-core VM minutes apart (2026-12-03), more than the simulator's goal."""
    rows = []
    for ctx in contexts:
        prompt = max(1, ctx - (n1 + n2) // 2)
        row = []
        for b in batches:
            def diff(b: int = b, prompt: int = prompt) -> float:  # bound now: _median calls it in this iteration
                t1 = timer(b, prompt, n1)
                return timer(b, prompt, n2) - t1

            row.append(max(_median(diff, repeats) / (n2 - n1), 1e-6))
        rows.append(row)
    return rows


# ---- the built-in engine, in this process -------------------------------------------------------------------------
def measure_engine(model_path: str, batches: list[int], contexts: list[int], threads: int = 1,
                   new_tokens: tuple[int, int] = (8, 40), precision: str = "float32",
                   repeats: int = 3, max_batch: int = 0, max_model_len: int = 0) -> tuple[EngineProfile, float]:
    """(EngineProfile, pause_s): the built-in engine's step-time grid, prefill tokens/s, and the seconds a weight
    swap of all parameters stops it (run_paused + load_weights, as a push does). The engine is sized as a run's
    server is: `max_batch` x `max_model_len` of KV cache (defaults: the largest batch measured, and just what the
    grid needs; measured on the demo model, 176 against 512 tokens moved the step by less than the noise)."""
    if threads > 0:
        torch.set_num_threads(threads)
    n1, n2 = new_tokens
    max_batch = max_batch or max(batches)
    max_model_len = max(max_model_len, max(contexts) + n2 + 8)
    eng = InferenceEngine(model_path, max_batch=max_batch, max_model_len=max_model_len,
                          threads=threads, generator_precision=precision)
    eng.start()
    vocab = eng.vocab_size
    rng = random.Random(0)

    def timer(b: int, prompt: int, new: int) -> float:
        sp = SamplingParams(max_tokens=new, ignore_eos=True)
        prompts = [[rng.randrange(2, vocab) for _ in range(prompt)] for _ in range(b)]

        async def one(rid: str, p: list[int]) -> None:
            async for _ in eng.generate(rid, p, sp, stream=False):
                pass

        async def go() -> None:
            await asyncio.gather(*[one(f"p{time.monotonic_ns()}-{i}", p) for i, p in enumerate(prompts)])

        t0 = time.perf_counter()
        asyncio.run(go())
        return time.perf_counter() - t0

    try:
        timer(2, 8, 4)  # warm-up (kernels built, caches touched)
        grid = _decode_grid(timer, batches, contexts, n1, n2, repeats)
        # prefill: distinct long prompts, one new token each (one decode step is negligible beside them)
        pb, plen = min(16, max(batches)), max(32, max(contexts) - n2)
        prefill_tok_s = pb * plen / _median(lambda: timer(pb, plen, 1), repeats)
        new = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
        pauses = []
        for _ in range(3):
            t0 = time.perf_counter()
            asyncio.run(eng.run_paused(lambda: eng.load_weights(new, eng.version + 1)))
            pauses.append(time.perf_counter() - t0)
    finally:
        eng.stop()
    prof = EngineProfile(name=backends.BUILTIN, model=model_path, devices=max(1, threads), max_batch=max_batch,
                         max_model_len=eng.max_model_len,
                         decode=DecodeCurve(batches=batches, contexts=contexts, step_s=grid),
                         prefill_tokens_per_s=prefill_tok_s)
    return prof, min(pauses)


# ---- any OpenAI-compatible server, over HTTP ----------------------------------------------------------------------
def measure_server(url: str, batches: list[int], contexts: list[int], model: str = "",
                   new_tokens: tuple[int, int] = (16, 80), api_key: str = "", repeats: int = 3) -> EngineProfile:
    """The step-time curve of a running server (vLLM, SGLang or inflight serve) from /v1/completions: b requests at
    once, ignore_eos, two lengths; prompts given as token ids (ids 5..94), so their lengths are exact."""
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(0)

    async def model_name(session: aiohttp.ClientSession) -> str:
        async with session.get(f"{base}/v1/models") as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]

    async def burst(b: int, prompt: int, new: int) -> float:
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as s:
            name = model or await model_name(s)

            async def one(i: int) -> None:
                # token ids (exact lengths, in any vocabulary), new ones every request: a server's prefix cache
                # (the built-in engine's prefix reuse, vLLM's prefix caching) must not skip the prefill
                ids = [5 + rng.randrange(90) for _ in range(prompt)]
                body: dict[str, Any] = {"model": name, "prompt": ids, "max_tokens": new, "ignore_eos": True,
                                        "temperature": 1.0}
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{base}/v1/completions: HTTP {r.status}: {(await r.text())[:300]}")
                    await r.read()

            t0 = time.perf_counter()
            await asyncio.gather(*[one(i) for i in range(b)])
            return time.perf_counter() - t0

    timer = lambda b, p, n: asyncio.run(burst(b, p, n))  # noqa: E731
    timer(2, 8, 4)
    n1, n2 = new_tokens
    grid = _decode_grid(timer, batches, contexts, n1, n2, repeats)
    pb, plen = min(16, max(batches)), max(32, max(contexts) - n2)
    prefill_tok_s = pb * plen / timer(pb, plen, 1)
    return EngineProfile(name=f"server {base}", model=model, max_batch=max(batches),
                         decode=DecodeCurve(batches=batches, contexts=contexts, step_s=grid),
                         prefill_tokens_per_s=prefill_tok_s)


# ---- the trainer --------------------------------------------------------------------------------------------------
def trainer_bench(model_path: str, cfg: TrainerConfig, group_size: int = 8, groups: int = 16, prompt: int = 8,
                  completion: int = 12, trainer: Any = None) -> tuple[Callable[[], tuple[float, float]], int]:
    """(step, tokens): step() runs forward + backward (all samples trained: advantages +-1) of `groups` groups of
    `group_size` samples sharing a prompt, packed as the trainer loop packs them, then the optimizer step, and
    returns (backward seconds, optimizer seconds); tokens counted as the simulator counts them: prompt +
    completion of every sample. `cfg`: TrainerConfig; `trainer`: one already made (default: a new one)."""

    if trainer is None:
        trainer = make_trainer(model_path, cfg)
        trainer.init()
    vocab = trainer.model.config.vocab_size
    rng = random.Random(0)
    samples, adv = [], []
    for g in range(groups):
        p = [rng.randrange(3, vocab) for _ in range(prompt)]
        for i in range(group_size):
            samples.append(Sample(f"g{g}", list(p), [rng.randrange(3, vocab) for _ in range(completion)],
                                  [-4.0] * completion, [0] * completion))
            adv.append(1.0 if i % 2 else -1.0)
    loss_fn = make_loss(AlgoConfig())
    n_tok = count_loss_tokens(samples)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        for mb in pack_samples(samples, adv, cfg.micro_batch_tokens, len(samples), n_tok):
            trainer.backward(mb, loss_fn)
        t1 = time.perf_counter()
        trainer.optimizer_step()
        return t1 - t0, time.perf_counter() - t1

    return step, sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)


def measure_trainer(model_path: str, cfg: TrainerConfig, group_size: int = 8, groups: int = 16, prompt: int = 8,
                    completion: int = 12, steps: int = 7) -> TrainerProfile:
    """Forward + backward tokens/s and the optimizer step's seconds (trainer_bench), medians of `steps` after a
    warm-up; and how the cost per token grows with the completion's length (`length_slope`): the same step with
    completions half as long, timed in turn with it. `cfg`: TrainerConfig."""
    trainer = make_trainer(model_path, cfg)
    trainer.init()
    step, tokens = trainer_bench(model_path, cfg, group_size, groups, prompt, completion, trainer=trainer)
    short = max(1, completion // 2)
    step2, _ = trainer_bench(model_path, cfg, group_size, groups, prompt, short, trainer=trainer)
    step(), step2()  # warm-up
    back, opt, back2 = [], [], []
    for _ in range(steps):
        b, o = step()
        back.append(b)
        opt.append(o)
        back2.append(step2()[0])
    b, b2, o = (statistics.median(v) for v in (back, back2, opt))
    devices = max(1, cfg.num_processes) if cfg.backend == "fsdp2" else 1
    prof = TrainerProfile(model=model_path, devices=devices, tokens_per_s=tokens / b, step_overhead_s=o,
                          prompt_tokens=prompt, completion_tokens=completion, group_size=group_size)
    if short < completion:  # seconds per forward token at both lengths -> relative growth per completion token
        forward = lambda c: groups * (prompt + group_size * c)  # noqa: E731  (each group's prompt once)
        long_s, short_s = b / forward(completion), b2 / forward(short)
        # a cost that falls with length is noise (a longer row never costs less): flat then
        prof.length_slope = min(0.1, max(0.0, (long_s - short_s) / (long_s * (completion - short))))
    return prof


# ---- the push ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def push_session(cfg: RunConfig, extra_args: tuple[str, ...] = ()) -> Iterator[tuple[str, Callable[[], tuple[float, float]]]]:
    """A real `inflight serve` process of the config's model, with the config's weight client and transport joined to
    it (trainer.protocol inflight): yields (its url, push), where push() sends the model's weights as the next
    version, as the trainer loop does after an optimizer step, and returns (seconds, the server's pause). `cfg`:
    RunConfig."""
    weights = [(n, p.detach()) for n, p in
               AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).named_parameters()]
    cfg = copy.deepcopy(cfg)
    cfg.pipeline.weight_sync_port = free_port()
    args = ["--threads", str(cfg.server.threads), "--max-model-len", str(cfg.server.max_model_len), *extra_args]
    version = 0
    with ServerProcess(cfg.model.path, extra_args=args) as server:
        client = make_weight_sync(cfg, [server.url])

        def push() -> tuple[float, float]:
            nonlocal version
            version += 1
            t0 = time.perf_counter()
            stats = client.push(weights, version=version)
            return time.perf_counter() - t0, max(stats["pause_s"].values())

        try:
            if cfg.trainer.weight_transport == "process_group":
                client.init_process_group()
            push()  # the first one sets buffers up
            yield server.url, push
        finally:
            client.close()


def measure_push(cfg: RunConfig, pushes: int = 6) -> tuple[float, float]:
    """(push seconds, server pause seconds), medians of `pushes` pushes to an idle server (push_session)."""
    times, pauses = [], []
    with push_session(cfg) as (_, push):
        for _ in range(pushes - 1):
            t, pause = push()
            times.append(t)
            pauses.append(pause)
            time.sleep(0.05)  # as between optimizer steps
    return statistics.median(times), statistics.median(pauses)
