"""The renderer and action parser of the guessing game (tests/openenv_task/guess_env.py), as a user writes them for
`task.env_args.renderer` / `action_parser`: plain functions over the observation's JSON and the reply's text."""

from __future__ import annotations

import re


def render(observation: dict, context: str) -> list[dict[str, str]]:
    """The first observation -> the question; a later one -> its feedback, as a user turn."""
    if context == "reset":
        return [{"role": "user", "content": observation["prompt"]}]
    return [{"role": "user", "content": f"{observation['feedback']} ({observation['guesses_left']} left)"}]


def render_observation_only(observation: dict) -> list[dict[str, str]]:
    """A renderer that takes no context: the same turns."""
    return [{"role": "user", "content": observation.get("prompt") or observation["feedback"]}]


def parse(reply: str) -> dict:
    """The reply's last integer as the guess; -1 when it holds none (the environment gives 0 for it)."""
    numbers = re.findall(r"\d+", reply)
    return {"guess": int(numbers[-1][:6]) if numbers else -1}
