"""Prefill tokens per multi-turn episode: what the built-in engine runs through the model today (every turn
prefills the whole episode so far: no prefix reuse), against what prefix reuse would leave (the first prompt, then
per later turn only the tokens the cache would lack: the previous turn's last sampled token and the environment's
delta).

    .venv/bin/inflight make-model --task arith runs/models/tiny-bench
    .venv/bin/python bench/episode_prefill.py --model runs/models/tiny-bench --episodes 16 --turns 4

Episodes: a scripted environment answers every model turn with a tool message until `--turns` model turns; the
measured figure is the server's own counter (`inflight_prefill_tokens_total` of /metrics) over the run, divided by
the number of episodes, and checked against the prompts the episodes sent.
"""

from __future__ import annotations

import argparse
import asyncio
import re

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


def prefill_counter(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^inflight_prefill_tokens_total (\S+)$", text, re.M).group(1))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    render = TurnRenderer(AutoTokenizer.from_pretrained(args.model))
    with ServerProcess(args.model, extra_args=["--threads", "1", "--max-model-len", "2048"]) as server:
        before = prefill_counter(server.url)
        samples = asyncio.run(episodes(server.url, render, args.episodes, args.turns, args.max_new_tokens))
        measured = (prefill_counter(server.url) - before) / len(samples)
    n = len(samples)
    sent = sum(s.meta["prefill_tokens"] for s in samples) / n
    prompt = sum(len(s.prompt_ids) for s in samples) / n
    model = sum(sum(s.loss_mask) for s in samples) / n
    env = sum(s.meta["env_tokens"] for s in samples) / n
    later = sum(s.meta["turns"] - 1 for s in samples) / n
    reuse = prompt + env + later  # per later turn: the previous turn's last token was never run through the model
    print(f"| episodes | turns | first prompt | model tokens | env tokens | prefill measured (no reuse) | "
          f"prompts sent | with prefix reuse | saving |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {n} | {sum(s.meta['turns'] for s in samples) / n:.1f} | {prompt:.0f} | {model:.0f} | {env:.0f} | "
          f"{measured:.0f} | {sent:.0f} | {reuse:.0f} | {measured / reuse:.1f}x |")


if __name__ == "__main__":
    main()
