"""A small OpenEnv environment for the tests, written against openenv-core's server API: a number-guessing game.

`reset(seed)` picks a secret in 1..50 from the seed and asks for a guess; each `step` takes a guess and answers
with feedback ("Too low." / "Too high." / "Correct!") and a reward that rewards closeness:
`1 - |guess - secret| / 50` (1.0 when right), 0.0 for no number (guess -1). The episode ends when the guess is right
or after MAX_GUESSES guesses. `secret_of(seed)` and `reward_of(guess, secret)` let a test recompute every reward.

Run as a server: `python -m tests.openenv_task.guess_env --port P [--max-sessions N]` (uvicorn, /ws sessions).
"""

from __future__ import annotations

import argparse
import random
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

MAX_GUESSES = 3
TOP = 50


def secret_of(seed: int) -> int:
    return random.Random(f"guess-{seed}").randint(1, TOP)


def reward_of(guess: int, secret: int) -> float:
    return 0.0 if guess < 0 else 1.0 - abs(guess - secret) / TOP


class GuessAction(Action):
    guess: int  # -1: the reply held no number


class GuessObservation(Observation):
    prompt: str = ""  # the question (reset)
    feedback: str = ""  # after a guess
    guesses_left: int = MAX_GUESSES


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # no shared state: one instance per session

    def __init__(self) -> None:
        super().__init__()
        self.secret = 0
        self._state = State()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self.secret = secret_of(seed or 0)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"I am thinking of a number between 1 and {TOP}. Guess it: reply with one "
                                       "number.", guesses_left=MAX_GUESSES)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        g = action.guess
        left = MAX_GUESSES - self._state.step_count
        if g == self.secret:
            feedback = "Correct!"
        elif g < 0:
            feedback = "That is not a number. Guess again."
        else:
            feedback = ("Too low." if g < self.secret else "Too high.") + " Guess again."
        return GuessObservation(feedback=feedback, guesses_left=left, reward=reward_of(g, self.secret),
                                done=g == self.secret or left <= 0)

    @property
    def state(self) -> State:
        return self._state


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-sessions", type=int, default=1)
    a = p.parse_args()
    app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=a.max_sessions)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
