"""The two contracts of inflight, and the data that crosses them.

1. Inference, over HTTP (any server that honours it plugs in; docs/inference-contract.md is the full text):
   `POST /v1/chat/completions` (OpenAI-compatible + token_ids / prompt_token_ids / token_versions per choice),
   `POST /init_process_group` and `POST /request_weight_update` (schemas below).
2. Training, in Python: the `TrainEngine` protocol below (init, forward_logprobs, backward, optimizer_step,
   named_weights).

Also here: the `Sample` that flows from actor to trainer, the packed `TrainBatch` the trainer consumes, the
`Task` interface of verifiable-reward tasks, and the `Stream` between actor and trainer.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # torch is heavy; contracts stay importable without it
    import torch

# --------------------------------------------------------------------------------------------------------------
# Inference contract: admin endpoints (the OpenAI-compatible part lives in inflight/engine/openai_api.py)
# --------------------------------------------------------------------------------------------------------------

WeightDType = Literal["float32", "bfloat16", "float16"]
UpdateMode = Literal["keep", "interrupt"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_GROUP_TIMEOUT_S = 600.0  # the most a process group's rendezvous or broadcast may wait
MAX_VERSION = 2**63 - 1  # versions travel as i64 (shm and ipc headers)


class InitProcessGroupRequest(_Strict):
    """Join the weight-update process group. Rank 0 (the trainer) hosts a TCPStore at master_address:master_port;
    each member builds the group directly on that store, no key prefix, separate from any default group."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="this server's first rank; the trainer is rank 0")
    world_size: int = Field(ge=2)
    backend: Literal["gloo", "nccl"] = "gloo"
    group_name: str = "inflight_weights"
    # the rendezvous and every broadcast of the group wait at most this long: bounded, so no request can make a
    # server wait on a group for longer (docs/inference-contract.md)
    timeout_s: float = Field(default=MAX_GROUP_TIMEOUT_S, gt=0, le=MAX_GROUP_TIMEOUT_S)


class ParamInfo(_Strict):
    name: str = Field(min_length=1)
    shape: list[int]
    dtype: WeightDType


class ShmSegment(_Strict):
    """A shared-memory segment of the same host holding an update (the trainer writes it once, every server on the
    host copies from it): a file of `bytes` bytes on a memory file system (/dev/shm), a SHM_HEADER_BYTES header
    (inflight/shm_weights.py: format, state, weight version, digest of the announcement, bytes written so far)
    then the tensors of `params` at the offsets of `shm_layout`."""

    path: str = Field(min_length=1)
    bytes: int = Field(gt=0, le=2**44)
    # the trainer promises to leave these bytes as they are until the server has answered its next update; servers
    # copy the segment all the same (it stays writable: docs/inference-contract.md, "Lent segments")
    lend: bool = False


class IpcBuffer(_Strict):
    """The trainer's flat update buffer, shared by handle with servers on its own device (transport `cuda_ipc`,
    inflight/cuda_ipc.py): IPC_HEADER_BYTES of header (magic, weight version, digest of the announcement), then the
    tensors of `params` at the offsets of `shm_layout`. The trainer exports it once and copies each update into it;
    the server opens it once and copies from it. Plain fields only: nothing is unpickled. `kind` "cuda": the
    fields of `torch.UntypedStorage._share_cuda_()` (binary ones base64); "cpu": the CPU stand-in, a shared-memory
    file at `path`."""

    kind: Literal["cuda", "cpu"]
    bytes: int = Field(gt=0, le=2**44, description="header + data: the part of the storage the update uses")
    device: int = Field(default=-1, ge=-1, description="CUDA device index (in the server's numbering); -1 for cpu")
    device_uuid: str | None = Field(default=None, max_length=64)  # cuda: the GPU's UUID (the same physical device)
    path: str | None = None  # cpu
    handle: str | None = None  # cuda: base64 cudaIpcMemHandle of the allocation
    storage_bytes: int = Field(default=0, ge=0)  # cuda: size of the shared storage
    storage_offset_bytes: int = Field(default=0, ge=0)  # cuda: where the storage starts in the allocation
    ref_counter_handle: str | None = None  # cuda: base64 name of the producer's reference-count file
    ref_counter_offset: int = Field(default=0, ge=0)
    event_handle: str | None = None  # cuda: base64 cudaIpcEventHandle (empty when no sync is required)
    event_sync_required: bool = False


class AdapterSpec(_Strict):
    """A LoRA adapter update (docs/inference-contract.md, "Adapter updates"): every announced tensor is
    `<base>.lora_A` [rank, in] or `<base>.lora_B` [out, rank], where `<base>` names a 2-D parameter [out, in] of
    the model; the server computes W = W0 + scaling * B @ A for each base and keeps W0 (the base weights)."""

    rank: int = Field(ge=1, le=65536)
    scaling: float = Field(allow_inf_nan=False)


LORA_SUFFIXES = (".lora_A", ".lora_B")


def adapter_pairs(params: list[ParamInfo], rank: int) -> dict[str, tuple[ParamInfo, ParamInfo]]:
    """{base name: (A, B)} of an adapter update's tensors, or ValueError naming every problem: a name without a
    .lora_A/.lora_B suffix, a base missing its A or its B, a tensor not 2-D, a rank other than `rank`, A and B of
    different dtypes. Whether each base exists in the model, with shape [B rows, A columns], is the server's check."""
    problems: list[str] = []
    halves: dict[str, dict[str, ParamInfo]] = {}
    for p in params:
        suffix = next((s for s in LORA_SUFFIXES if p.name.endswith(s)), None)
        if suffix is None or len(p.name) == len(suffix):
            problems.append(f"'{p.name}' is not '<base>.lora_A' or '<base>.lora_B'")
            continue
        halves.setdefault(p.name[: -len(suffix)], {})[suffix] = p
    pairs: dict[str, tuple[ParamInfo, ParamInfo]] = {}
    for base, h in halves.items():
        a, b = h.get(".lora_A"), h.get(".lora_B")
        if a is None or b is None:
            problems.append(f"'{base}' has {'no .lora_A' if a is None else 'no .lora_B'}")
            continue
        if len(a.shape) != 2 or len(b.shape) != 2:
            problems.append(f"'{base}': lora_A {a.shape} and lora_B {b.shape} must both be 2-D")
            continue
        if a.shape[0] != rank or b.shape[1] != rank:
            problems.append(f"'{base}': lora_A {a.shape} and lora_B {b.shape} do not have rank {rank} "
                            "(A is [rank, in], B is [out, rank])")
            continue
        if a.dtype != b.dtype:
            problems.append(f"'{base}': lora_A is {a.dtype}, lora_B is {b.dtype}")
            continue
        pairs[base] = (a, b)
    if problems:
        raise ValueError("; ".join(problems))
    return pairs


def served_adapter_name(prefix: str, version: int) -> str:
    """The name a LoRA run's adapter of `version` is loaded under on stock vLLM servers (trainer.protocol=vllm):
    requests that name it run under exactly that version (the trainer loads it, the actor asks for it)."""
    return f"{prefix}-v{int(version)}"


class WeightUpdateRequest(_Strict):
    """Announce an update. Exactly one transport: `params` alone (broadcasts from rank 0, in this order: one per
    tensor, or with `bucket_bytes` > 0 one per bucket of `bucket_layout`), `params` with `shm` (a shared-memory
    segment on the server's host), or `path` (a safetensors file readable on the server's host, e.g. under
    /dev/shm)."""

    version: int = Field(ge=0, le=MAX_VERSION, description=(
        "never lower than the version the server holds (409), unless `new_run`"))
    new_run: bool = Field(default=False, description=(
        "the first update of a trainer (a new run, or one resumed from an older checkpoint): its version may be "
        "lower than the one served"))
    params: list[ParamInfo] | None = None
    path: str | None = None
    shm: ShmSegment | None = None
    ipc: IpcBuffer | None = None  # the trainer's device buffer (same device): transport cuda_ipc
    mode: UpdateMode = "keep"
    bucket_bytes: int = Field(default=0, ge=0, le=2**40, description=(
        "0: one broadcast per tensor; > 0: tensors packed into flat byte buffers of at most this size (bucket_layout)"))
    adapter: AdapterSpec | None = Field(default=None, description=(
        "set: the tensors are a LoRA adapter (adapter_pairs) merged into the kept base weights; a full update "
        "(adapter unset) replaces the base weights and drops any adapter"))

    @model_validator(mode="after")
    def _one_transport(self) -> "WeightUpdateRequest":
        if (self.params is None) == (self.path is None):
            raise ValueError("give exactly one of 'params' (process-group broadcast or 'shm' segment) or 'path' "
                             "(safetensors file)")
        if self.shm is not None and self.params is None:
            raise ValueError("'shm' needs 'params' (the tensors the segment holds, in order)")
        if self.ipc is not None and (self.params is None or self.shm is not None or self.bucket_bytes):
            raise ValueError("'ipc' needs 'params' (the tensors the buffer holds, in order), without 'shm' or "
                             "'bucket_bytes' (the buffer has the layout of shm_layout)")
        if self.shm is not None and self.bucket_bytes:
            raise ValueError("'bucket_bytes' is for broadcasts; an 'shm' segment has its own layout (shm_layout)")
        if self.params is not None:
            dup = {n for n, k in Counter(p.name for p in self.params).items() if k > 1}
            if dup:
                raise ValueError(f"duplicate tensor names: {sorted(dup)}")
            if not self.params:
                raise ValueError("'params' is empty")
            if self.adapter is not None:
                adapter_pairs(self.params, self.adapter.rank)
        return self


DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
BUCKET_ALIGN = 64  # bytes: every packed tensor starts at a multiple of this


def bucket_layout(params: list[ParamInfo], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """The broadcasts of a bucketed update, which both ends derive from the announcement: the tensors in announced
    order, each at the next multiple of BUCKET_ALIGN bytes of the current bucket, a new bucket whenever the next
    tensor would not fit in `bucket_bytes`. A bucket is [(param index, byte offset), ...]. A bucket of one tensor is
    broadcast as that tensor (its shape and dtype); a bucket of several as one flat uint8 buffer of
    `packed_bytes(...)` bytes. Many small tensors then cost one broadcast, large ones are never copied."""
    buckets: list[list[tuple[int, int]]] = []
    end = bucket_bytes  # the current bucket's used bytes (full: start a new one)
    for i, p in enumerate(params):
        start = -(-end // BUCKET_ALIGN) * BUCKET_ALIGN
        nbytes = _param_bytes(p)
        if not buckets or start + nbytes > bucket_bytes:
            buckets.append([])
            start = 0
        buckets[-1].append((i, start))
        end = start + nbytes
    return buckets


def shm_layout(params: list[ParamInfo]) -> tuple[list[int], int]:
    """Byte offsets of the tensors in a shared-memory segment's data (after its header), in announced order, each at
    the next multiple of BUCKET_ALIGN, and the data's size: the layout of one bucket that holds everything."""
    (bucket,) = bucket_layout(params, 2**62)
    i, offset = bucket[-1]
    return [off for _, off in bucket], offset + _param_bytes(params[i])


def packed_bytes(params: list[ParamInfo], bucket: list[tuple[int, int]]) -> int:
    """The size of a bucket's flat uint8 buffer; 0 for a bucket of one tensor, which travels as that tensor."""
    if len(bucket) == 1:
        return 0
    i, offset = bucket[-1]
    return offset + _param_bytes(params[i])


def _param_bytes(p: ParamInfo) -> int:
    n = DTYPE_BYTES[p.dtype]
    for d in p.shape:
        n *= d
    return n


def tied_aliases(model: Any) -> dict[str, str]:
    """{alias: canonical name} for every parameter registered under more than one name (tie_word_embeddings:
    {"lm_head.weight": "model.embed_tokens.weight"}). The canonical name is the one `named_parameters()` reports
    (the first registration): a weight update carries each shared tensor once, under that name, and an alias in an
    update is rejected (docs/inference-contract.md, "Tied weights")."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if canonical[id(p)] != n}


class WeightUpdateResponse(BaseModel):
    version: int
    pause_s: float


# Extension fields every choice of a chat/completion response carries (besides OpenAI's own):
CHOICE_EXTENSIONS = ("token_ids", "prompt_token_ids", "token_versions")
FinishReason = Literal["stop", "length", "abort"]


# --------------------------------------------------------------------------------------------------------------
# Data: what the actor produces
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Training contract
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Tasks with verifiable rewards
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Environments: multi-turn episodes (tools, user turns)
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# The stream from actor to trainer
# --------------------------------------------------------------------------------------------------------------


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
