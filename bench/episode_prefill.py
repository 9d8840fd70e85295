"""Prefill tokens per multi-turn episode, with the built-in engine's prefix reuse off and on: without it every turn
prefills the whole episode so far; with it (engine/scheduler/prefix_cache.py) a later turn continues the previous turn's
retained KV and prefills only the tokens the cache lacks (the previous turn's last sampled token, never run
through the model, and the environment's delta).

    .venv/bin/inflight make-model --task arith runs/models/tiny-bench
    .venv/bin/python bench/episode_prefill.py --model runs/models/tiny-bench --episodes 16 --turns 4

Episodes: a scripted environment answers every model turn with a tool message until `--turns` model turns. One
server per setting (`--no-prefix-reuse` / `--prefix-reuse`), the same episodes run on each; the measured figures
are the server's own counters (`inflight_prefill_tokens_total`, `inflight_prefix_reused_tokens_total` of /metrics)
over the run, per episode, checked against the prompts the episodes sent; "expected" is what exact reuse of each
episode's own previous turn leaves (first prompt + environment tokens + one token per later turn). Wall time is
that of all episodes at once (concurrent), so it includes decoding, HTTP and the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time

import httpx
from transformers import AutoTokenizer

from inflight.actor import ActorConfig, ServerPool
from inflight.actor.episode import EpisodeConfig, run_episode
from inflight.actor.rollout import RolloutClient
from inflight.actor.turns import TurnRenderer
from inflight.contracts import StepResult, TaskSample
from inflight.engine.serve import ServerProcess


class ToolEveryTurn:
    def __init__(self, turns: int):
        self.turns, self.n = turns, 0

    def reset(self, ts):
        return ts.messages

    def step(self, reply):
        self.n += 1
        if self.n >= self.turns:
            return StepResult(reward=0.0, done=True)
        return StepResult([{"role": "tool", "content": f"result: {56088 + self.n}"}])


def counters(url: str) -> tuple[float, float]:
    """(prefill tokens, reused prompt tokens) so far, from the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return tuple(float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # type: ignore[return-value]
                 for name in ("inflight_prefill_tokens_total", "inflight_prefix_reused_tokens_total"))


async def episodes(url: str, render: TurnRenderer, n: int, turns: int, max_new: int):
    pool = ServerPool([url])
    client = RolloutClient(pool, ActorConfig(max_new_tokens=max_new, temperature=1.0))
    ts = TaskSample("b", [{"role": "user", "content": "What is 123*456? Use <calc>...</calc>."}], "56088")
    try:
        return await asyncio.gather(*(run_episode(ts, ToolEveryTurn(turns), client, render,
                                                  EpisodeConfig(max_turns=turns, max_tokens=10_000))
                                      for _ in range(n)))
    finally:
        await pool.aclose()


def measure(args, render: TurnRenderer, reuse: bool) -> dict:
    flag = "--prefix-reuse" if reuse else "--no-prefix-reuse"
    with ServerProcess(args.model, extra_args=["--threads", "1", "--max-model-len", "2048", flag]) as server:
        before = counters(server.url)
        t0 = time.perf_counter()
        samples = asyncio.run(episodes(server.url, render, args.episodes, args.turns, args.max_new_tokens))
        wall = time.perf_counter() - t0
        after = counters(server.url)
    n = len(samples)
    prefill, reused = ((a - b) / n for a, b in zip(after, before))
    sent = sum(s.meta["prefill_tokens"] for s in samples) / n
    prompt = sum(len(s.prompt_ids) for s in samples) / n
    later = sum(s.meta["turns"] - 1 for s in samples) / n
    env = sum(s.meta["env_tokens"] for s in samples) / n
    assert abs(prefill + reused - sent) < 1e-6, (prefill, reused, sent)  # every prompt token: run or reused
    return dict(reuse=reuse, n=n, turns=sum(s.meta["turns"] for s in samples) / n, prompt=prompt, env=env,
                model=sum(sum(s.loss_mask) for s in samples) / n, sent=sent, prefill=prefill, reused=reused,
                expected=sent if not reuse else prompt + env + later, wall=wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    render = TurnRenderer(AutoTokenizer.from_pretrained(args.model))
    rows = [measure(args, render, reuse) for reuse in (False, True)]
    print("| prefix reuse | episodes | turns | first prompt | model tokens | env tokens | prompts sent | "
          "prefill measured | reused measured | expected prefill | wall s (all episodes) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'on' if r['reuse'] else 'off'} | {r['n']} | {r['turns']:.1f} | {r['prompt']:.0f} | "
              f"{r['model']:.0f} | {r['env']:.0f} | {r['sent']:.0f} | {r['prefill']:.0f} | {r['reused']:.0f} | "
              f"{r['expected']:.0f} | {r['wall']:.1f} |")
    off, on = rows
    print(f"\nprefill tokens per episode: {off['prefill']:.0f} -> {on['prefill']:.0f} "
          f"({off['prefill'] / on['prefill']:.1f}x fewer); wall {off['wall']:.1f} s -> {on['wall']:.1f} s")


if __name__ == "__main__":
    main()
