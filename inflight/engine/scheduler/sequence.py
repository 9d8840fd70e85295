"""What the engine thread keeps per request and per sequence (one sequence per choice), and the events it emits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from inflight.engine.model.prompt_scores import PromptScores
from inflight.engine.model.sampling import SamplingParams


class VersionNotReached(RuntimeError):
    """A request's min_version was not reached within its version_wait_s (the server answers 409)."""


@dataclass
class TokenEvent:
    index: int  # choice index 0..n-1
    token_id: int  # -1 on a final event that carries no token (abort)
    logprob: float
    version: int
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" on the last event of the choice
    prompt: PromptScores | None = None  # on choice 0's first event, when the request scores its prompt
    time: float = 0.0  # time.monotonic() when its step sampled it (0.0: not stamped); the server's metrics
    scheduled: float | None = None  # on choice 0's first event from a step: when the request was first scheduled
    constrained: bool = False  # drawn from a grammar-masked distribution (SamplingParams.structured, grammar.py)
    raw_logprob: float | None = None  # a constrained token's logprob without the mask (step.raw_logprobs)


class Request:
    def __init__(self, rid: str, prompt: list[int], params: SamplingParams, stop_ids: set[int], loop, queue,
                 stream: bool, min_version: int = 0, deadline: float = float("inf")):
        self.rid, self.prompt, self.params, self.stop_ids = rid, prompt, params, stop_ids
        self.loop, self.queue = loop, queue
        self.min_version, self.deadline = min_version, deadline  # held until the weights reach min_version
        self.seqs: list[Seq] = []
        self.unfinished = params.n
        self.held: list[TokenEvent] | None = None if stream else []  # events kept until the request ends
        self.scheduled = 0.0  # time.monotonic() when it got its KV slots (0.0: not yet)
        self.new_matcher: Callable[[], Any] | None = None  # a constrained request: makes each choice's matcher


class Seq:
    __slots__ = ("req", "index", "slot", "tokens", "num_cached", "kv_version", "n_gen", "gen", "active",
                 "split_pending", "done", "scores", "matcher")

    def __init__(self, req: Request, index: int, slot: int, num_cached: int = 0, kv_version: int | None = None):
        self.req, self.index, self.slot = req, index, slot
        self.tokens = list(req.prompt)
        self.num_cached = num_cached  # tokens whose KV is in the cache (> 0 at once: a reused prefix)
        self.kv_version = kv_version  # the oldest weight version of that KV (prefix_cache.py)
        self.n_gen = 0
        seed = req.params.seed
        self.gen = None if seed is None else torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**63)
        self.active = index == 0  # choices > 0 start when choice 0 has prefilled the shared prompt
        self.split_pending = index == 0 and req.params.n > 1
        self.done = False
        k = req.params.prompt_logprobs  # choice 0 prefills the prompt, so it scores it
        self.scores = PromptScores(req.prompt, k) if k is not None and index == 0 else None
        self.matcher = req.new_matcher() if req.new_matcher is not None else None  # its grammar's state (grammar.py)
