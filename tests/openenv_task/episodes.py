"""Plays the guessing game's held-out episodes through task.name=openenv against a real inference server, and checks
one episode against what the game must have answered: exact tokens, masked feedback turns, the game's rewards."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from inflight.actor import ActorConfig, ServerPool
from inflight.actor.episode import EpisodeConfig, run_episode
from inflight.actor.turns import TurnRenderer
from inflight.contracts import Sample, TaskSample
from inflight.trainer.packing import collate, count_loss_tokens
from tests.actor.helpers import Recording
from tests.openenv_task.guess_agent import parse
from tests.openenv_task.guess_env import MAX_GUESSES, TOP, reward_of, secret_of

QUESTION = [{"role": "user", "content": f"I am thinking of a number between 1 and {TOP}. Guess it: reply with one "
                                        "number."}]


def play(task, server_url: str, model_dir: Path, max_new_tokens: int = 12) -> list[tuple[TaskSample, list, Sample]]:
    """Every held-out episode at once (more than the game server's sessions): [(sample, completions, episode)]."""
    render = TurnRenderer(AutoTokenizer.from_pretrained(model_dir))

    async def main():
        pool = ServerPool([server_url], retries=1, request_timeout_s=120)
        try:
            async def one(ts):
                client = Recording(pool, ActorConfig(group_size=1, max_new_tokens=max_new_tokens, temperature=1.0))
                s = await run_episode(ts, task.make_env(ts), client, render, EpisodeConfig(max_turns=5, max_tokens=400))
                return ts, client.seen, s
            return await asyncio.gather(*(one(ts) for ts in task.eval_samples()))
        finally:
            await pool.aclose()

    return asyncio.run(main())


def expected_game(replies: list[str], seed: int) -> tuple[list[float], list[str]]:
    """What the game answers to these replies: each step's reward, and the feedback turns before the last reply."""
    secret, rewards, feedback = secret_of(seed), [], []
    for k, reply in enumerate(replies):
        g = parse(reply)["guess"]
        rewards.append(reward_of(g, secret))
        if g == secret or k + 1 == MAX_GUESSES:
            break
        word = "That is not a number." if g < 0 else "Too low." if g < secret else "Too high."
        feedback.append(f"{word} Guess again. ({MAX_GUESSES - k - 1} left)")
    return rewards, feedback


def check_episode(tok, ts: TaskSample, seen: list, s: Sample) -> None:
    """The episode holds the model's turns exactly as sampled, the game's feedback rendered once and masked in
    between, and the rewards the game gave; the trainer's batch trains exactly the sampled tokens."""
    assert s.label in ("correct", "wrong"), s.meta.get("env_error")  # the game ended every episode
    rewards, feedback = expected_game([c.text for c in seen], ts.meta["seed"])
    assert len(seen) == len(rewards) == s.meta["turns"] == s.meta["env_steps"] and len(feedback) == len(seen) - 1
    assert s.meta["turn_rewards"] == pytest.approx(rewards, abs=0) and s.reward == pytest.approx(sum(rewards))
    # the first prompt is the reset observation rendered by the renderer, through the chat template
    assert s.prompt_ids == seen[0].prompt_ids == list(tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False))
    r = TurnRenderer(tok)
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    for k, c in enumerate(seen):  # model turn | feedback delta | model turn ...
        assert c.prompt_ids == s.prompt_ids + ids  # each turn continued from exactly the episode so far
        ids, mask, lps = ids + c.token_ids, mask + [1] * len(c.token_ids), lps + c.logprobs
        if k < len(feedback):
            d = r.delta(c.token_ids, [{"role": "user", "content": feedback[k]}])
            ids, mask, lps = ids + d, mask + [0] * len(d), lps + [0.0] * len(d)
    assert s.completion_ids == ids and s.loss_mask == mask and s.logprobs == pytest.approx(lps)
    b = collate([s], [1.0], 1, count_loss_tokens([s]))
    trained = b.loss_mask > 0
    assert b.input_ids[trained].tolist() == [t for c in seen for t in c.token_ids]
    assert b.behaviour_logprobs[trained].tolist() == pytest.approx([x for c in seen for x in c.logprobs])
