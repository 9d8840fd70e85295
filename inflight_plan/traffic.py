"""How much more a run's engine step costs than a plain decode step of the same batch and context
(`EngineProfile.run_step_factor`, measured by `inflight profile`).

The decode curve is timed on plain batches: every sequence starts at once, runs to the same length, in slots 0..b-1.
A run's steps are not like that: groups of n choices join a running batch (a prefill chunk, then the prompt's KV
copied to the n - 1 other slots), sequences stop at their own stop tokens and leave gaps, and most steps mix these.
On a 2-core CPU the difference was 10-30% per step at the same batch and context (2026-12-03), above the planner's
goal, so it is measured rather than assumed away.

Measured on the real engine in this process, with the config's prompts (its task's training samples, rendered by the
chat template as the server renders them) and its sampling settings:
    run      a closed loop keeps max_batch // group_size groups in flight; each step, once the batch is full and
             before it drains, is timed against the curve's time at the step's batch and context plus its prefill
             tokens at the profile's rate;
    plain    a plain batch at the run's mean batch and context, timed in turn in the same engine, against the curve.
factor = (run seconds / curve seconds) / (plain seconds / curve seconds), the median over rounds: a machine that is
faster or slower now than when the curve was timed moves both alike and cancels out.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics

import torch

from inflight.config import RunConfig
from inflight.engine.core import InferenceEngine
from inflight.engine.model.sampling import SamplingParams
from inflight.tasks import get_task
from inflight_plan.profile import EngineProfile


def _curve_s(profile: EngineProfile, trace: list[tuple[int, int, int, float]]) -> float:
    return sum(profile.decode.step_time(nd, ctx / nd) + pre / profile.prefill_tokens_per_s
               for nd, ctx, pre, _ in trace if nd)


def _measured_s(trace: list[tuple[int, int, int, float]]) -> float:
    return sum(dt for nd, _, _, dt in trace if nd)


def measure_run_step_factor(cfg: RunConfig, profile: EngineProfile, rounds: int = 5, groups_per_round: int = 0,
                            ) -> tuple[float, dict[str, float]]:
    """(factor, details): see the module docstring. `cfg`: RunConfig (model, task, server threads and sizes, the
    actor's group size, max_new_tokens and temperature). Each round runs `groups_per_round` groups (default: enough
    for a few hundred steady steps) and a plain batch."""
    srv, act = cfg.server, cfg.actor
    if srv.threads > 0:
        torch.set_num_threads(srv.threads)
    eng = InferenceEngine(cfg.model.path, max_batch=srv.max_batch, max_model_len=srv.max_model_len,
                          threads=srv.threads, generator_precision=srv.generator_precision)
    vocab = eng.vocab_size
    G = act.group_size
    in_flight = max(1, srv.max_batch // G)
    total = groups_per_round or in_flight * max(4, -(-400 // act.max_new_tokens))  # a few hundred steady steps
    samples = get_task(cfg.task).train_samples(cfg.seed)
    ids = itertools.count()
    rng = random.Random(0)

    def prompt() -> list[int]:
        ids_ = eng.tokenizer.apply_chat_template(next(samples).messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return list(ids_.tolist() if hasattr(ids_, "tolist") else ids_)

    async def generate(p: list[int], sp: SamplingParams) -> None:
        async for _ in eng.generate(f"t{next(ids)}", p, sp, stream=False):
            pass

    def run_round() -> list:
        """The closed loop; the trace of its steady part (the first wave over, nothing draining yet)."""
        sp = SamplingParams(max_tokens=act.max_new_tokens, temperature=act.temperature, n=G)
        state = {"done": 0, "started": 0}
        steady: list = []
        trace: list[tuple[int, int, int, float]] = []  # the engine appends a tuple per step while it is set

        async def group() -> None:
            state["started"] += 1
            if state["started"] == total:  # the last group starts: the batch drains from here
                steady.extend(trace)
            await generate(prompt(), sp)
            state["done"] += 1
            if state["done"] == in_flight:  # the first wave is over: the batch is mixed from here on
                trace.clear()

        async def loop() -> None:
            gate = asyncio.Semaphore(in_flight)

            async def one() -> None:
                async with gate:
                    await group()
            await asyncio.gather(*[one() for _ in range(total)])

        eng.step_trace = trace
        asyncio.run(loop())
        eng.step_trace = None
        return steady

    def plain_round(batch: int, context: int) -> list:
        new = 24
        sp = SamplingParams(max_tokens=new, ignore_eos=True, temperature=act.temperature)
        p_len = max(1, context - new // 2)
        prompts = [[rng.randrange(2, vocab) for _ in range(p_len)] for _ in range(batch)]

        async def go() -> None:
            await asyncio.gather(*[generate(p, sp) for p in prompts])

        eng.step_trace = []
        asyncio.run(go())
        trace, eng.step_trace = eng.step_trace, None
        return [s for s in trace if s[2] == 0]  # decode steps only (the first one prefills)

    eng.start()
    try:
        run_round()  # warm-up
        ratios, runs, plains = [], [], []
        for _ in range(rounds):
            run = run_round()
            if not run:
                raise RuntimeError("traffic: no steady steps (too few groups per round for the batch)")
            decodes = [s for s in run if s[0]]
            batch = max(1, round(sum(s[0] for s in decodes) / max(1, len(decodes))))
            context = max(2, round(sum(s[1] for s in run) / max(1, sum(s[0] for s in run))))
            plain = plain_round(batch, context)
            r_run, r_plain = _measured_s(run) / _curve_s(profile, run), _measured_s(plain) / _curve_s(profile, plain)
            ratios.append(r_run / r_plain)
            runs.append(r_run)
            plains.append(r_plain)
    finally:
        eng.stop()
    details = {"batch": batch, "context": context, "steps": len(decodes), "run_over_curve": statistics.median(runs),
               "plain_over_curve": statistics.median(plains),
               "prefill_share": sum(s[2] for s in run) / max(1, sum(s[0] + s[2] for s in run))}
    return statistics.median(ratios), details
