"""A hardware profile: what the simulator knows about one inference server and the trainer on some machine, as a
small JSON file (`inflight profile` measures one; inflight_plan/profiles/ holds some built from public figures).

    decode step time t(batch, context)   seconds of one decode step of `batch` sequences of mean length `context`
    prefill tokens/s                     prompt (and re-prefill) tokens per second of one server
    trainer tokens/s                     forward + backward tokens per second of `devices` trainer devices
    push / pause seconds                 one weight update: trainer-side seconds until every server has it, and the
                                         seconds a server stops generating to swap the weights in

Every figure says where it came from (`source`): a prediction made from a profile names the profile.
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

# what `inflight profile` wrote in the notes before the trainer's shape had fields of its own
_SHAPE = re.compile(r"trainer measured on (\d+)-token prompts, (\d+)-token completions")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DecodeCurve(_Strict):
    """Seconds per decode step on a grid: step_s[i][j] at contexts[i], batches[j]. Between grid points the time is
    interpolated linearly (bilinear); past the largest batch it is extrapolated from the last two points, past the
    context range it is clamped (a curve measured at one context is flat in context)."""

    batches: list[int] = Field(min_length=1)
    contexts: list[int] = Field(min_length=1)
    step_s: list[list[float]]

    @model_validator(mode="after")
    def _check(self) -> DecodeCurve:
        if self.batches != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ValueError("decode.batches must be increasing and >= 1")
        if self.contexts != sorted(set(self.contexts)) or self.contexts[0] < 1:
            raise ValueError("decode.contexts must be increasing and >= 1")
        if len(self.step_s) != len(self.contexts) or any(len(r) != len(self.batches) for r in self.step_s):
            raise ValueError("decode.step_s must have one row per context and one value per batch")
        if any(v <= 0 for r in self.step_s for v in r):
            raise ValueError("decode.step_s values must be > 0")
        return self

    def _row(self, row: list[float], batch: float) -> float:
        bs = self.batches
        if len(bs) == 1:
            return row[0] * batch / bs[0]  # one point: proportional (CPU-like) is the only honest guess
        j = min(max(bisect.bisect_left(bs, batch), 1), len(bs) - 1)
        b0, b1, y0, y1 = bs[j - 1], bs[j], row[j - 1], row[j]
        if batch <= b0:  # below the smallest batch: flat (a step never gets cheaper than at the smallest batch)
            return y0
        return max(y0 + (y1 - y0) * (batch - b0) / (b1 - b0), 1e-12)

    def step_time(self, batch: float, context: float) -> float:
        cs = self.contexts
        if len(cs) == 1 or context <= cs[0]:
            return self._row(self.step_s[0], batch)
        if context >= cs[-1]:
            return self._row(self.step_s[-1], batch)
        i = bisect.bisect_left(cs, context)
        c0, c1 = cs[i - 1], cs[i]
        y0, y1 = self._row(self.step_s[i - 1], batch), self._row(self.step_s[i], batch)
        return y0 + (y1 - y0) * (context - c0) / (c1 - c0)


class EngineProfile(_Strict):
    name: str = ""  # e.g. "builtin", "vllm 0.x"
    model: str = ""
    devices: int = Field(1, ge=1)  # devices (GPUs, or CPU threads) one server uses
    max_batch: int = Field(128, ge=1)  # the largest batch measured / allowed
    max_model_len: int = Field(0, ge=0)  # the KV cache's length per sequence it was measured with (0: not recorded)
    decode: DecodeCurve
    prefill_tokens_per_s: float = Field(gt=0)
    # a run's engine step (groups joining a running batch, sequences stopping at their own lengths) over a plain
    # decode step of the same batch and context, prefill included (traffic.py); 1: not measured
    run_step_factor: float = Field(1.0, gt=0)


class TrainerProfile(_Strict):
    model: str = ""
    devices: int = Field(1, ge=1)  # devices the tokens/s was measured on
    tokens_per_s: float = Field(gt=0)  # forward + backward tokens per second (trained samples only)
    step_overhead_s: float = Field(0.0, ge=0)  # per optimizer step: the optimizer, gradient clipping, bookkeeping
    scaling: float = Field(1.0, gt=0, le=1)  # tokens/s at T devices = tokens_per_s * (T / devices) ** scaling
    # the step shape tokens_per_s was measured on (`inflight profile`): groups of `group_size` samples sharing a
    # `prompt_tokens` prompt, `completion_tokens` each, tokens counted as prompt + completion of every sample. The
    # trainer runs a group's prompt once (trainer/prefix.py), so the rate per token it computes is higher by
    # forward_share(). 0: unknown (a rate from public figures): tokens_per_s is taken as per computed token.
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    group_size: int = Field(0, ge=0)
    # how the cost per computed token grows with the completion's length (each token's attention row), relative to
    # the measured shape, per completion token: the cost at length L is (1 + length_slope (L - completion_tokens))
    # times the measured one. 0: not measured (flat)
    length_slope: float = Field(0.0, ge=-0.1, le=0.1)

    def tokens_per_s_at(self, devices: int) -> float:
        return self.tokens_per_s * (devices / self.devices) ** self.scaling

    def forward_share(self, group_size: int = 0) -> float:
        """Tokens the trainer's forward ran over / tokens counted in tokens_per_s, on the measured shape:
        (P + G C) / (G (P + C)). `group_size` stands in for an unrecorded one (older profiles: the config's)."""
        g = self.group_size or group_size
        p, c = self.prompt_tokens, self.completion_tokens
        if not (g and c):
            return 1.0
        return (p + g * c) / (g * (p + c))

    def length_factor(self, completion: float) -> float:
        """Cost per computed token at mean completion length `completion`, over the measured shape's (>= 0.25)."""
        if not (self.length_slope and self.completion_tokens):
            return 1.0
        return max(0.25, 1.0 + self.length_slope * (completion - self.completion_tokens))

    def forward_tokens_per_s_at(self, devices: int, group_size: int = 0) -> float:
        """Tokens/s the trainer computes (each group's prompt once) on T devices: what the simulator charges."""
        return self.tokens_per_s_at(devices) * self.forward_share(group_size)


class Profile(_Strict):
    version: int = 1
    source: str  # where the numbers come from: "measured on <host> <date> by inflight profile" or the citations
    notes: str = ""  # assumptions
    engine: EngineProfile
    trainer: TrainerProfile
    push_s: float = Field(0.0, ge=0)  # optimizer step done -> every server holds the new weights
    # seconds a push takes more while the trainer trains its next step (the push runs on a thread of its process),
    # while the servers decode (their receiving thread shares the engine's interpreter), and while both do (on
    # shared cores, more than the sum: every wake-up of the push's threads then waits for a core); corun.py
    push_beside_train_s: float = Field(0.0, ge=0)
    push_beside_decode_s: float = Field(0.0, ge=0)
    push_beside_both_s: float = Field(0.0, ge=0)
    pause_s: float = Field(0.0, ge=0)  # a server's stop to swap the weights in
    overhead_s: float = Field(0.0, ge=0)  # per group: latency from its last token to the trainer (network, stream)
    # per group: seconds of the actor's own serial work (reply decoding, reward scoring, stream put), one group at a
    # time; negligible on GPU clusters, not on 2 shared CPU cores
    actor_s_per_group: float = Field(0.0, ge=0)
    # per group: seconds of its server's HTTP work to answer it (building the reply with token ids and logprobs, on
    # the server's HTTP thread: the built-in engine's thread shares the interpreter with it, server_http_stall)
    server_s_per_group: float = Field(0.0, ge=0)
    # the reply work's share that grows with the group's completion tokens (logprob lists, detokenising, JSON)
    server_s_per_token: float = Field(0.0, ge=0)
    # per group: seconds of the server's HTTP work when its requests arrive (parsing, the chat prompt, submission)
    server_s_per_request: float = Field(0.0, ge=0)
    # the server's HTTP work (server_s_per_*) runs on its own thread beside the engine's: seconds the engine thread
    # loses per second of it (the interpreter lock the two share; reply.py measures it). 1: decoding stops meanwhile
    server_http_stall: float = Field(1.0, ge=0)
    # seconds the engine thread still computes meanwhile, per second of that work (handing the lock back and forth):
    # for that share of its stall it wants a core (contention.py)
    server_http_spin: float = Field(0.0, ge=0)
    actor_s_per_token: float = Field(0.0, ge=0)
    # times the actor's event loop and a server's HTTP thread are put on a CPU per group they handle (reply.py counts
    # them), and the wait for a core of a thread that wakes up while every core is taken (corun.py): where roles
    # share cores, each of those wake-ups waits that long (a latency on the group's path, not work)
    actor_wakeups_per_group: float = Field(0.0, ge=0)
    server_wakeups_per_group: float = Field(0.0, ge=0)
    wakeup_wait_s: float = Field(0.0, ge=0)
    # per group on the trainer, besides back-propagating it: reading it from the stream and decoding it (every
    # group, trained samples or not)
    trainer_s_per_group: float = Field(0.0, ge=0)
    trainer_s_per_token: float = Field(0.0, ge=0)
    # how many times slower the trainer / a server computes while the other computes on the same machine, on cores
    # of their own (shared cache and memory bandwidth; corun.py); only contention.py (roles sharing one machine)
    # applies them, never roles on devices of their own
    trainer_corun: float = Field(1.0, ge=1)
    server_corun: float = Field(1.0, ge=1)

    def server_reply_s(self, completion_tokens: int) -> float:
        """Seconds of HTTP work a group of `completion_tokens` costs its server (the reply)."""
        return self.server_s_per_group + self.server_s_per_token * completion_tokens

    def actor_reply_s(self, completion_tokens: int) -> float:
        """The actor's serial seconds for a group of `completion_tokens`."""
        return self.actor_s_per_group + self.actor_s_per_token * completion_tokens

    def trainer_read_s(self, completion_tokens: int) -> float:
        """The trainer's seconds to take a group of `completion_tokens` from the stream."""
        return self.trainer_s_per_group + self.trainer_s_per_token * completion_tokens

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
        data.pop("_comment", None)  # the profiles built from public figures carry their sources in a comment
        trainer = data.get("trainer")
        if isinstance(trainer, dict) and "completion_tokens" not in trainer:  # measured before the shape was kept
            m = _SHAPE.search(str(data.get("notes", "")))
            if m:
                trainer.update(prompt_tokens=int(m[1]), completion_tokens=int(m[2]))
        return cls.model_validate(data)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1) + "\n")
        return path
