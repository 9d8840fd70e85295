"""The data that crosses inflight's two contracts, and the protocols each side implements.

1. Inference, over HTTP (any server that honours it plugs in; docs/inference-contract.md is the full text):
   `POST /v1/chat/completions` (OpenAI-compatible + token_ids / prompt_token_ids / token_versions per choice),
   `POST /init_process_group` and `POST /request_weight_update` (their schemas: inflight/transport/schemas.py).
2. Training, in Python: the `TrainEngine` protocol below (init, forward_logprobs, backward, optimizer_step,
   named_weights).

Also here: the `Sample` that flows from actor to trainer, the packed `TrainBatch` the trainer consumes, the
`Task` interface of verifiable-reward tasks, and the `Stream` between actor and trainer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is heavy; contracts stay importable without it
    import torch

# Extension fields every choice of a chat/completion response carries (besides OpenAI's own):
CHOICE_EXTENSIONS = ("token_ids", "prompt_token_ids", "token_versions")
FinishReason = Literal["stop", "length", "abort"]


# Data: what the actor produces


@dataclass
class Sample:
    """One generated completion, exactly as sampled (token ids and behaviour logprobs are never re-computed from
    text), plus its reward. `versions[t]` is the weight version that produced completion token t."""

    group_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour policy mu: the server's sampling logprob of each completion token
    versions: list[int]
    reward: float = 0.0
    label: str = ""  # a Verdict value
    finish_reason: str = "stop"
    task_id: str = ""  # id of the TaskSample it answers
    meta: dict[str, Any] = field(default_factory=dict)
    # per completion token: 1 = sampled by the model (trained), 0 = inserted by an environment (tool output, user
    # turn: never trained; its logprob and version are placeholders, 0.0 and -1). None = every token is the model's.
    loss_mask: list[int] | None = None

    def model_versions(self) -> list[int]:
        """The versions of the tokens the model sampled (an environment's tokens left out)."""
        if self.loss_mask is None:
            return self.versions
        return [v for v, m in zip(self.versions, self.loss_mask, strict=False) if m]

    @property
    def first_version(self) -> int:
        v = self.model_versions()
        return v[0] if v else -1

    @property
    def last_version(self) -> int:
        v = self.model_versions()
        return v[-1] if v else -1

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


Group = list[Sample]  # the G samples of one prompt (GRPO's group)


# Training contract


@dataclass
class TrainBatch:
    """One packed micro-batch: whole samples laid end to end in a single row of T tokens.

    Per-token tensors have shape [T] and index t describes the prediction of `input_ids[t]` from the tokens before
    it in the same sample; `loss_mask` is 0 on prompt tokens and on the first token of every sample.
    `num_samples_in_step` / `num_tokens_in_step` count the whole optimizer step (all micro-batches, all ranks), so
    that losses normalise the same way however the step is split.
    """

    input_ids: "torch.Tensor"  # [T] long
    position_ids: "torch.Tensor"  # [T] long, restarting at 0 for each sample
    seq_lens: list[int]  # sample lengths in order; sum == T
    loss_mask: "torch.Tensor"  # [T] float (1 = completion token that is trained)
    advantages: "torch.Tensor"  # [T] float
    behaviour_logprobs: "torch.Tensor"  # [T] float, mu (the server's)
    versions: "torch.Tensor"  # [T] long, weight version that generated the token (-1 on prompt tokens)
    sample_index: "torch.Tensor"  # [T] long, index of the sample (within this micro-batch) the token belongs to
    num_samples_in_step: int = 1
    num_tokens_in_step: int = 1
    prox_logprobs: "torch.Tensor | None" = None  # pi_prox, decoupled PPO (trainer's weights before this step)
    ref_logprobs: "torch.Tensor | None" = None  # reference model, for the KL term
    temperature: float = 1.0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class LossFn(Protocol):
    """An RL objective: per-token new logprobs [T] (with grad) and the batch -> (scalar loss, stats). The trainers
    compute them on the trained tokens (batch.loss_mask > 0); the other tokens may hold 0.
    `entropy` is the per-token policy entropy [T] when the loss asked for it, else None."""

    needs_entropy: bool

    def __call__(
        self, logprobs: "torch.Tensor", batch: TrainBatch, entropy: "torch.Tensor | None"
    ) -> tuple["torch.Tensor", dict[str, float]]: ...


@runtime_checkable
class TrainEngine(Protocol):
    """What every training backend (single device, FSDP2, ...) implements."""

    version: int  # number of optimizer steps taken == the weight version it would publish

    def init(self) -> None:
        """Load weights (any HF causal LM by path), shard them if the backend shards, build optimizer + schedule."""

    def forward_logprobs(self, batch: TrainBatch) -> "torch.Tensor":
        """Per-token logprobs [T] of batch.input_ids under the current weights (temperature-aware), no grad."""

    def backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate the gradient of loss_fn on one micro-batch; return its stats."""

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, zero grads, advance `version`; return at least grad_norm and lr."""

    def named_weights(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        """The full updated weights, one tensor at a time (gathered layer by layer when sharded), HF names: those
        of `named_parameters()`, so a tied tensor comes once, under its canonical name (see `tied_aliases`)."""


# Tasks with verifiable rewards


class Verdict(str, enum.Enum):
    correct = "correct"
    wrong = "wrong"
    no_answer = "no_answer"
    truncated = "truncated"
    error = "error"


@dataclass
class TaskSample:
    id: str
    messages: list[dict[str, str]]  # chat messages, OpenAI style
    answer: str  # the gold answer, as text
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Verification:
    reward: float
    label: Verdict


class Task(Protocol):
    name: str

    def train_samples(self, seed: int) -> Iterator[TaskSample]:
        """An endless, seeded stream of training prompts."""

    def eval_samples(self) -> list[TaskSample]:
        """The held-out split (disjoint from training prompts)."""

    def verify(self, completion: str, sample: TaskSample, finish_reason: str = "stop") -> Verification:
        """Score a completion; a `length` finish without an answer is `truncated`."""


# Environments: multi-turn episodes (tools, user turns)


@dataclass
class StepResult:
    """What an environment answers to one model reply: the messages that follow it (tool output, the next user
    turn; OpenAI style), a reward for this step (None: none), whether the episode is over, and any metrics (e.g.
    {"tool_calls": 1}), summed over the episode into the sample's meta."""

    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    """One episode of a multi-turn task; a fresh instance per episode (the actor runs G of them per prompt).
    Methods may be plain or async; plain ones run in a worker thread. Every call is bounded by a timeout: an
    environment that hangs or raises ends its episode as failed (reward 0, label `error`), never the actor.

    The episode's reward is the sum of the step rewards given (typically one outcome reward with done=True).
    An environment may also define `close()` (plain or async): called once when its episode ends, however it
    ended (done, truncated, failed), under the same timeout; and `async open()`: awaited before reset without a
    timeout, to wait for a shared resource (a free session of an environment server), released in close(). An
    environment with tools sets `tools` (OpenAI's [{"type": "function", "function": {name, description,
    parameters}}]) by the end of `reset`: where the chat template renders tools they go to the server with the first
    prompt, else they are described in a system message; the model's calls are in its reply text either way
    (tasks/tool_calls.py)."""

    def reset(self, sample: TaskSample) -> list[dict[str, str]]:
        """The first messages (the prompt the model answers first)."""

    def step(self, reply: str) -> StepResult:
        """The model's reply (its text) -> what follows it."""


@runtime_checkable
class EnvTask(Task, Protocol):
    """A task whose samples are multi-turn episodes: the actor runs `make_env(sample)` for each episode."""

    def make_env(self, sample: TaskSample) -> Environment: ...


# The stream from actor to trainer


class Stream(Protocol):
    """Ordered, at-least-once delivery of groups from producer (actor) to consumer (trainer)."""

    def put(self, groups: list[Group]) -> None: ...

    def get(self, max_groups: int, timeout_s: float | None = None) -> list[Group]: ...

    def ack(self, position: int) -> None:
        """The consumer has durably used everything up to `position` (for restart from the last ack)."""

    @property
    def produced(self) -> int: ...

    @property
    def consumed(self) -> int: ...

    def publish_version(self, version: int) -> None:
        """Trainer side: the weight version the servers now have (the actor's staleness bound reads it)."""

    def trainer_version(self) -> int:
        """Actor side: the last version the trainer published (-1 before any; 0 = initial weights)."""


RolloutFn = Callable[..., Any]  # async def rollout(task_sample, client, cfg) -> list[Sample]; see inflight/actor
