"""The built-in inference engine: continuous batching over an engine-managed KV cache, on its own thread.

One engine step = one forward over a flat batch of tokens: every decoding sequence contributes its last token,
then waiting prompts (and sequences being re-prefilled after an `interrupt` weight update) contribute chunks
until `max_tokens_per_step` is used (schedule.py). New requests join at the next step; finished sequences leave at
once. Priorities (SamplingParams.priority, lower first) order admission and prefill. Held-out evaluation (priority
> 0) stays out of the way of rollouts and weight updates: at most `low_priority_prefill` of its prompt tokens per
step, at most `low_priority_seqs` of its sequences at once, and none of its work while an update is on its way
(`update_incoming`), so a pause never waits for a step that only evaluation needed.
llama / qwen2 models run through our own forward (llama_runner.py); any other causal LM through HF (hf_runner.py).

Logprobs: see sampling.py. In short, the log-probability under the distribution the token was sampled from
(after temperature and top-k/top-p renormalisation); for greedy (temperature 0), the temperature-1 logprob.
A stop token (stop_token_ids, or EOS unless ignore_eos) is emitted as the last token, with finish_reason "stop".
Structured outputs (SamplingParams.structured, grammar.py): a constrained choice samples from logits masked by its
grammar (the rest of the batch decodes freely) and ends with "stop" once its grammar is complete.
An aborted choice (abort(), a cancelled consumer, stop()) ends with an event of token_id -1, finish_reason "abort".
`generate(..., stream=False)` holds a request's events on the engine thread and hands them over once, when its
last choice ends: a consumer that only wants the whole completion is not woken once per step.

Prefix reuse (`prefix_reuse`, prefix_cache.py): a finished sequence's slot keeps its KV while no one needs the
slot, and a request whose prompt continues it (a multi-turn episode's next turn) prefills only the rest. Only KV
of the current weights is reused: every update (keep or interrupt) drops what is retained, and a sequence that ran
across a `keep` update is not retained. So a request still runs entirely on the weights of the versions its tokens
carry, exactly as with a full prefill (keep mode's stale KV stays confined to the sequences running at the update).

Prompt logprobs (prompt_scores.py): a request with `prompt_logprobs` gets the logits of every prompt position from
its prefill chunks (never from a reused prefix), scored as they come; choice 0's first event carries them.

Weight updates: `await run_paused(fn)` runs fn on the engine thread between two steps; inside it,
`load_weights(tensors, version, mode)` validates everything, then copies all tensors in place. Each TokenEvent
carries the version of the weights of the forward that produced it. `generate(..., min_version=v)` holds a request
on the engine thread until the weights reach v, and admits it in the same loop turn as the pause that brings them
(an RL actor can send a step's requests before the weights they need exist); after `version_wait_s` it fails with
VersionNotReached instead.

CUDA (`cuda_graphs`, graph_runner.py): pure decode steps replay a CUDA graph per batch bucket (weight updates copy in
place, so the graphs stay valid); sampling and stop checks run on the device (device_sampling.py).

Precision (precision.py): the HF model stays the full-precision master; its parameters (on the fast path, views of
fused matrices) change only in place (load_weights), never by rebinding `.data`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.config.engine import EngineSettings
from inflight.transport.layout import tied_aliases
from inflight.engine.model import llama_runner
from inflight.engine.model import precision
from inflight.engine.scheduler import schedule
from inflight.engine.scheduler import step
from inflight.engine.model.device_sampling import DeviceSampler
from inflight.engine.model.grammar import Grammars
from inflight.engine.model.graph_runner import DecodeGraphs, graphs_enabled
from inflight.engine.model.hf_runner import HFRunner
from inflight.engine.scheduler.mailbox import Mailbox
from inflight.engine.scheduler.prefix_cache import Slots
from inflight.engine.model.sampling import SamplingParams
from inflight.engine.scheduler.sequence import Request as _Request, Seq as _Seq, TokenEvent, VersionNotReached
from inflight.modelkit.stops import stop_token_ids
from inflight.modelkit.check import check_model_dir

log = logging.getLogger(__name__)
T = TypeVar("T")


class InferenceEngine:
    scores_prompts = True  # computes prompt logprobs (SamplingParams.prompt_logprobs, prompt_scores.py)
    constrains_outputs = True  # grammar-constrained decoding (SamplingParams.structured, grammar.py)

    def __init__(self, model_path: str, settings: EngineSettings | None = None, *, device: str = "cpu",
                 device_sampling: bool | None = None, **overrides: Any):
        """`settings`: the engine's settings (config/engine.py: `server.*`, `inflight serve` options; a ServerConfig
        is one), checked there; `overrides` replace some of them (`InferenceEngine(path, max_batch=4)`)."""
        s = dataclasses.replace(settings or EngineSettings(), **overrides)
        if s.threads > 0:
            torch.set_num_threads(s.threads)
        self.device = torch.device(device)
        precision.check_precision(s.generator_precision, self.device)
        if os.path.isdir(model_path):  # else a hub name: transformers explains its own errors
            check_model_dir(model_path)  # a clear error for a folder that is not a causal LM
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, s.dtype))
        # transformers wraps nn.Module.to with functools.wraps, and mypy then takes the device for `self`
        self.model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]
        self.model_name = os.path.basename(os.path.normpath(model_path))
        cfg = self.model.config
        self.max_model_len = min(s.max_model_len, getattr(cfg, "max_position_embeddings", None) or s.max_model_len)
        self.max_batch = max_batch = s.max_batch
        self.max_tokens_per_step = max(1, s.max_tokens_per_step)
        self.low_priority_prefill, self.low_priority_seqs = s.low_priority_prefill, s.low_priority_seqs
        embeddings: Any = self.model.get_input_embeddings()  # an nn.Embedding (or a subclass), per architecture
        self.vocab_size: int = embeddings.num_embeddings
        # generation config's eos ids, the tokenizer's eos and the chat template's end-of-turn token (stops.py)
        self.eos_ids = stop_token_ids(cfg, self.model.generation_config, self.tokenizer)
        why_not = llama_runner.supports(self.model)
        graphs = graphs_enabled(s.cuda_graphs, self.device, why_not)  # only on the fast path
        self.runner: llama_runner.LlamaRunner | HFRunner
        self.graphs: DecodeGraphs | None = None
        if why_not is None:  # CUDA graphs: one more KV slot, the padding rows' scratch
            runner = llama_runner.LlamaRunner(self.model, max_batch + graphs, self.max_model_len, s.generator_precision)
            if graphs:  # the graphs hold the weights' and the cache's addresses: updates copy in place from now on
                runner.pin_storage()
                self.graphs = DecodeGraphs(runner, max_batch, capture=self.device.type == "cuda")
                log.info("decode steps: %s", self.graphs.status)
            self.runner = runner
        elif s.generator_precision != "float32":
            raise ValueError(f"generator_precision {s.generator_precision!r} needs the fast llama path: {why_not}")
        else:
            log.warning("the fast llama/qwen2 forward does not cover this model (%s): using the generic HF forward "
                        "(slower)", why_not)
            self.runner = HFRunner(self.model, max_batch, self.max_model_len)
        self.fast_path = why_not is None
        on_device = self.device.type != "cpu" if device_sampling is None else device_sampling
        self.sampler = DeviceSampler(max_batch, self.device, self.max_model_len) if on_device else None
        self.generator_precision = s.generator_precision
        self._params = dict(self.model.named_parameters())  # tied aliases left out: updates never name them
        self.tied_aliases = tied_aliases(self.model)  # e.g. lm_head.weight -> model.embed_tokens.weight
        self.version = 0
        self._grammars: Grammars | None = None  # structured outputs (grammar.py), made by the first that needs them
        self._grammars_lock = threading.Lock()
        # state owned by the engine thread; finished sequences' slots kept for prefix reuse (the HF runner cannot
        # shorten its caches: there only a sequence's whole KV is reused)
        self._slots = Slots(max_batch, self.runner.reset_slot, s.prefix_reuse, exact_only=not self.fast_path)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._held: list[_Request] = []  # waiting for weights of their min_version, in arrival order
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Request] = {}
        self._rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))
        self._out: dict[_Request, list[TokenEvent]] = {}
        self._mailbox = Mailbox()  # this step's events to the consumers' loops
        # cross-thread inboxes
        self._cv = threading.Condition()
        self._inbox: collections.deque[_Request] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._pause_calls: collections.deque = collections.deque()
        self._ids: set[str] = set()  # request ids not yet finished (guarded by _cv)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._in_pause = False
        self._incoming = 0  # weight updates being received (update_incoming): evaluation steps wait for them
        self._st = dict(generated_tokens_total=0, paused_seconds_total=0.0, steps=0, prefill_tokens_total=0,
                        prefix_reused_tokens_total=0)
        # set to a list to record every step as (decodes, their summed context, prefill tokens, seconds): the
        # profiler's view of a step under real traffic (inflight_plan/traffic.py)
        self.step_trace: list[tuple[int, int, int, float]] | None = None

    # ---------------------------------------------------------------- public API (any thread / asyncio loop)
    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="inflight-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            with self._cv:
                self._stopping = True
                self._cv.notify()
            self._thread.join()
            self._thread = None

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming the problem; generate() runs it too (on its first iteration)."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        params.check(self.max_batch)
        if params.structured is not None:
            self.grammars().compile(params.structured)  # cached: the request's grammar is valid

    def grammars(self) -> Grammars:
        """The engine's compiled grammars and matchers (grammar.py), made on first use."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._grammars

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       stream: bool = True, min_version: int = 0,
                       version_wait_s: float | None = None) -> AsyncIterator[TokenEvent]:
        """The request's events, as they are generated, or (stream=False) all of them once it has ended. With
        `min_version`, nothing starts before the weights reach it; VersionNotReached after `version_wait_s`."""
        self.validate_request(prompt_ids, params)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        deadline = float("inf") if version_wait_s is None else time.monotonic() + version_wait_s
        req = _Request(request_id, list(prompt_ids), params, stop_ids, asyncio.get_running_loop(), asyncio.Queue(),
                       stream, min_version, deadline)
        if params.structured is not None:
            grammars, compiled = self.grammars(), self.grammars().compile(params.structured)
            req.new_matcher = lambda: grammars.matcher(compiled)
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is stopped")
            if request_id in self._ids:
                raise ValueError(f"request id {request_id!r} is already running")
            self._ids.add(request_id)
            self._inbox.append(req)
            self._cv.notify()
        remaining = params.n
        try:
            while remaining:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    remaining = 0
                    raise item
                for ev in item:
                    remaining -= ev.finish_reason is not None
                    yield ev
        finally:
            if remaining:  # consumer cancelled or stopped early: free the slots
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}

    async def run_paused(self, fn: Callable[[], T]) -> T:
        if self._thread is None:
            raise RuntimeError("engine is not started")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._pause_calls.append((fn, fut))
            self._cv.notify()
        return await asyncio.wrap_future(fut)

    @contextlib.contextmanager
    def update_incoming(self) -> Iterator[None]:
        """Held by the weight receiver from the moment an update arrives until it is applied: meanwhile no step
        runs evaluation (priority > 0) work, so the pause starts as soon as the rollouts' step allows."""
        with self._cv:
            self._incoming += 1
        try:
            yield
        finally:
            with self._cv:
                self._incoming -= 1
                self._cv.notify()

    def _has_work(self) -> bool:
        if not self._incoming:
            return bool(self._running or self._waiting)
        return (any(s.req.params.priority <= 0 for s in self._running)
                or any(r.params.priority <= 0 and r.params.n <= self._slots.available() for r in self._waiting))

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int, mode: str = "keep") -> None:
        if not (self._in_pause and threading.current_thread() is self._thread):
            raise RuntimeError("load_weights must be called inside run_paused")
        if mode not in ("keep", "interrupt"):
            raise ValueError(f"mode must be 'keep' or 'interrupt', not {mode!r}")
        errors = []
        for name, t in tensors.items():
            p = self._params.get(name)
            if name in self.tied_aliases:
                errors.append(f"{name!r} is tied to {self.tied_aliases[name]!r}: update it under that name")
            elif p is None:
                errors.append(f"unknown parameter {name!r}")
            elif not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape):
                errors.append(f"{name}: shape {tuple(getattr(t, 'shape', ()))} != {tuple(p.shape)}")
        if errors:
            raise ValueError("; ".join(errors[:10]))
        with torch.no_grad():
            for name, t in tensors.items():
                self._params[name].data.copy_(t)  # in place: converts dtype/device, keeps the runner's views
        self.runner.after_weight_update()
        self.version = int(version)
        if mode == "interrupt":
            for s in self._running:
                s.num_cached = 0  # re-prefill prompt + tokens so far before the next token
        self._slots.drop_retained()  # a request after the update starts from the new weights only (both modes)

    def stats(self) -> dict[str, float]:
        running = len(self._running)
        return dict(running=running, waiting=len(self._waiting) + len(self._inbox) + len(self._held),
                    batch_occupancy=running / self.max_batch, version=self.version, retained=self._slots.retained,
                    **self._st)

    # ---------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._inbox or self._aborts or self._pause_calls or self._has_work()):
                    first = min((r.deadline for r in self._held), default=float("inf"))
                    if first == float("inf"):
                        self._cv.wait()
                    elif not self._cv.wait(max(0.0, first - time.monotonic())):
                        break  # a held request's deadline passed
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, collections.deque()
                aborts, self._aborts = self._aborts, collections.deque()
                pauses, self._pause_calls = self._pause_calls, collections.deque()
            for fn, fut in pauses:
                self._run_pause(fn, fut)
            for req in inbox:
                self._by_id[req.rid] = req
                self._held.append(req)
            if self._held:
                self._release_held()
            for rid in aborts:
                self._abort(rid)
            try:
                self._admit()
                if self._running:
                    self._step()
            except Exception as e:  # never die silently: fail every request in flight
                log.exception("engine step failed")
                for req in list(self._by_id.values()):
                    self._finish_request(req)
                    req.loop.call_soon_threadsafe(req.queue.put_nowait, e)
                self._running, self._waiting, self._held, self._out = [], collections.deque(), [], {}
                self._slots.reset_all()
            self._flush()
        with self._cv:  # stopping: answer everything still queued
            inbox, self._inbox = self._inbox, collections.deque()
            pauses, self._pause_calls = self._pause_calls, collections.deque()
        for fn, fut in pauses:
            fut.set_exception(RuntimeError("engine stopped"))
        for req in inbox:
            self._by_id[req.rid] = req
            self._waiting.append(req)
        self._waiting.extend(self._held)
        self._held = []
        for rid in list(self._by_id):
            self._abort(rid)
        self._flush()

    def _run_pause(self, fn, fut) -> None:
        t0 = time.perf_counter()
        self._in_pause = True
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)
        finally:
            self._in_pause = False
            self._st["paused_seconds_total"] += time.perf_counter() - t0

    def _release_held(self) -> None:
        """Requests whose weights have arrived join the waiting queue (arrival order kept); those past their
        deadline end with VersionNotReached."""
        now, keep = time.monotonic(), []
        for req in self._held:
            if req.min_version <= self.version:
                self._waiting.append(req)
            elif req.deadline <= now:
                self._finish_request(req)
                err = VersionNotReached(f"the weights are at version {self.version}; min_weight_version "
                                        f"{req.min_version} was not reached in time")
                req.loop.call_soon_threadsafe(req.queue.put_nowait, err)
            else:
                keep.append(req)
        self._held = keep

    def _admit(self) -> None:
        """Start waiting requests, lowest `priority` first (then arrival), while the first one's n choices fit: a
        request never waits behind later or less urgent ones that happen to be smaller."""
        if not self._waiting:
            return
        order = sorted(self._waiting, key=lambda r: r.params.priority)  # stable: arrival order within a priority
        low = sum(s.req.params.priority > 0 for s in self._running) if self.low_priority_seqs else 0
        k, now = 0, time.monotonic()
        while k < len(order) and self._slots.available() >= order[k].params.n:
            req = order[k]
            if req.params.priority > 0 and self.low_priority_seqs:  # the rest of `order` is low priority too
                if low and low + req.params.n > self.low_priority_seqs:
                    break
                low += req.params.n
            # choice 0 continues a retained sequence, unless the prompt is scored: reused positions have no logits
            hit = self._slots.take(req.prompt, self.version) if req.params.prompt_logprobs is None else None
            if hit is not None:
                self._st["prefix_reused_tokens_total"] += hit[1]
            first = _Seq(req, 0, *hit) if hit is not None else _Seq(req, 0, self._slots.alloc())
            req.seqs = [first] + [_Seq(req, i, self._slots.alloc()) for i in range(1, req.params.n)]
            req.scheduled = now  # the server's queue-time metric (TokenEvent.scheduled)
            self._running.extend(req.seqs)
            k += 1
        if k:
            started = set(map(id, order[:k]))
            self._waiting = collections.deque(r for r in self._waiting if id(r) not in started)

    def _emit(self, req: _Request, ev: TokenEvent) -> None:
        (self._out.setdefault(req, []) if req.held is None else req.held).append(ev)

    def _flush(self) -> None:
        """Hand this step's events to the consumers (mailbox.py)."""
        out, self._out = self._out, {}
        self._mailbox.send(out)

    def _finish_request(self, req: _Request) -> None:
        if req.held:
            self._out.setdefault(req, []).extend(req.held)
            req.held = []
        self._by_id.pop(req.rid, None)
        with self._cv:
            self._ids.discard(req.rid)

    def _release(self, s: _Seq, reason: str, event: TokenEvent | None = None) -> None:
        s.done = True
        current = s.kv_version == self.version  # KV of older weights (kept across a `keep` update) is not retained
        self._slots.release(s.slot, s.tokens[: s.num_cached], s.kv_version if current else None)
        self._emit(s.req, event or TokenEvent(s.index, -1, 0.0, self.version, None, reason))
        s.req.unfinished -= 1
        if s.req.unfinished == 0:
            self._finish_request(s.req)

    def _abort(self, rid: str) -> None:
        req = self._by_id.get(rid)
        if req is None:
            return
        if req in self._waiting or req in self._held:
            (self._waiting if req in self._waiting else self._held).remove(req)
            for i in range(req.params.n):
                self._emit(req, TokenEvent(i, -1, 0.0, self.version, None, "abort"))
            self._finish_request(req)
            return
        for s in req.seqs:
            if not s.done:
                self._release(s, "abort")
        self._running = [s for s in self._running if not s.done]

    def _step(self) -> None:
        t0 = time.perf_counter()
        # evaluation waits while a weight update is on its way (update_incoming)
        ch = schedule.choose(self._running, self.max_tokens_per_step, self.version, self.low_priority_prefill,
                             hold=self._incoming > 0)
        self._st["prefill_tokens_total"] += ch.prefill_tokens
        if not ch.chunks:
            return
        self._forward_and_sample(ch.chunks, ch.want, ch.seqs, ch.decodes, ch.score)
        if self.step_trace is not None:
            nd = ch.decodes
            ctx = sum(start + 1 for _, start, _ in ch.chunks[:nd])
            self.step_trace.append((nd, ctx, sum(len(ids) for _, _, ids in ch.chunks[nd:]), time.perf_counter() - t0))

    def _forward_and_sample(self, chunks: list[step.Chunk], want: list[bool], seqs: list[_Seq], nd: int,
                            score: list[int]) -> None:
        """The step's forward and sampling (step.py); here, what they mean for the requests: the sequences whose
        request generates nothing (max_tokens 0: the prompt was only scored) end, the others get their token."""
        version = self.version
        logits, rows, sampled = step.forward(self.runner, self.graphs, self.device, chunks, want, nd, score, seqs,
                                             version)
        self._st["steps"] += 1
        if any(s.req.params.max_tokens == 0 for s in sampled):  # the prompt scored, nothing to generate
            keep, now = [i for i, s in enumerate(sampled) if s.req.params.max_tokens > 0], time.monotonic()
            for s in sampled:
                if s.req.params.max_tokens == 0:
                    ev = TokenEvent(s.index, -1, 0.0, version, None, "length", s.scores)
                    s.scores = None
                    _stamp(ev, s, now)
                    self._release(s, "length", ev)
            self._running = [s for s in self._running if not s.done]
            rows, sampled = [rows[i] for i in keep], [sampled[i] for i in keep]
        if not sampled:
            return
        if len(rows) != sum(want):  # choices sharing a row, or rows left out
            logits = logits[torch.tensor(rows, device=logits.device)]
        events = step.sample_next(logits, sampled, self._rng, self.sampler, self.runner.kernels, self.max_model_len,
                                  version, self._grammars)
        finished, now = False, time.monotonic()
        for s, ev in zip(sampled, events):
            _stamp(ev, s, now)
            if ev.finish_reason is None:
                self._emit(s.req, ev)
            else:
                self._release(s, ev.finish_reason, ev)
                finished = True
        self._st["generated_tokens_total"] += len(sampled)
        if finished:
            self._running = [s for s in self._running if not s.done]


def _stamp(ev: TokenEvent, s: _Seq, now: float) -> None:
    """The timings the server's metrics read from an event: when its step sampled it, and on choice 0's first
    event, when its request was scheduled."""
    ev.time = now
    if s.index == 0 and s.n_gen <= 1:
        ev.scheduled = s.req.scheduled
