from dataclasses import dataclass, field
from typing import Any


@dataclass
class TaskConfig:
    name: str = "arith"  # arith | arith_tool | math_jsonl | reasoning_gym | verifiers | openenv
    seed: int = 0
    eval_size: int = 200
    # arith
    digits: int = 2  # operands have 1..digits digits
    terms: int = 2  # number of operands
    operators: list[str] = field(default_factory=lambda: ["+"])
    scratchpad: bool = False  # step-by-step solutions (generation-heavy variant; terms then vary in 2..terms)
    prompt: str = ""  # arith question template with {expr}; "" = "What is {expr}? Answer in \\boxed{}." (or step by step)
    # how the reply's answer is read (arith): boxed = the last \\boxed{...}; last_number = the last number of the
    # reply, what small instruct models write ("2 + 7 = 9"); its default question then asks for the number only
    answer_format: str = "boxed"
    # math_jsonl
    path: str = ""  # .jsonl or .parquet
    question_field: str = "question"
    answer_field: str = "answer"
    eval_path: str = ""  # held-out file; empty = hold out the last eval_size rows of `path`
    # reasoning_gym
    dataset: str = ""  # a reasoning-gym dataset name, e.g. "basic_arithmetic"
    system_prompt: str = ""  # every task: a system message before the question ("" = none: the chat template's default)
    # multi-turn tasks (arith_tool): one sample per episode (inflight/actor/episode.py)
    max_turns: int = 4  # model turns per episode
    max_episode_tokens: int = 0  # completion tokens per episode, model + environment; 0 = 2 * max_turns * max_new_tokens
    env_timeout_s: float = 10.0  # an environment call (reset, step: a tool) slower than this fails the episode
    tool_role: str = "tool"  # arith_tool, verifiers: the role of a tool's turn (a template without one: "user")
    # arith_tool: one worked exchange before the question (a question, <calc>12*34</calc>, the tool's 408, \boxed{408}):
    # a small instruct model that has never seen the tool calls it in ~10% of samples with it, ~0-2% without
    tool_demo: bool = False
    # verifiers: an environment of the verifiers library (0.1-0.3: tasks/verifiers_env.py, 0.4: tasks/verifiers_v1.py;
    # pip install 'inflight-rl[verifiers]')
    # openenv: an OpenEnv environment server (tasks/openenv_env.py; pip install openenv-core); its env_args: renderer,
    # action_parser ('module:function'), reward (sum | final), reset_args, max_sessions
    env: str = ""  # verifiers: environment id / module / file.py (0.4: a taskset id); openenv: the server's URL
    env_args: dict[str, Any] = field(default_factory=dict)  # verifiers: load_environment kwargs (0.4: its [env] block); openenv: docs/architecture.md
