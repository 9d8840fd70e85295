"""`VLLMEngine`: vLLM's `AsyncLLM` seen through the engine interface of inflight's HTTP layer
(inflight/engine/api/server.py: `generate`, `abort`, `tokenizer`, `model_name`, `max_model_len`, `version`, `stats`).

So the OpenAI endpoints, their validation, stop strings, streaming and errors are inflight's own code — the same
schemas and messages as the built-in server by construction — while scheduling, KV cache, sampling and logprobs
are vLLM's.

Per-token weight versions are vLLM's own bookkeeping, exact: the engine core stamps every step's outputs with its
current weight version, which only changes while generation is paused; the output processor records, per request,
the output-token index where each version starts (`RequestState.weight_version_starts`; on the final output,
`CompletionOutput.weight_versions`). We read those spans, never the clock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator

from transformers import AutoConfig, AutoTokenizer

from inflight.engine.core import TokenEvent, VersionNotReached
from inflight.engine.model.sampling import SamplingParams

log = logging.getLogger("inflight.vllm.engine")


def _version_int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0  # vLLM's initial label "default" = the weights the server started with


class VLLMEngine:
    def __init__(self, llm: Any, model_dir: str, *, model_name: str | None = None):
        self.llm = llm
        mc = llm.vllm_config.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_name = model_name or os.path.basename(os.path.normpath(model_dir))
        self.max_model_len = int(mc.max_model_len)
        self.max_batch = int(llm.vllm_config.scheduler_config.max_num_seqs)
        self.vocab_size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
        self._version = 0
        self._version_changed = asyncio.Event()  # set (and replaced) whenever the version changes
        self.generated_tokens = 0
        self.paused_seconds = 0.0
        self._live: dict[str, list[str]] = {}  # inflight request id -> vLLM request ids (one per choice)

    # The app's lifespan calls these; vLLM's engine lives as long as the process.
    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.llm.shutdown()

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:  # the receiver sets it on the event loop, right after an update
        self._version = value
        self._version_changed.set()
        self._version_changed = asyncio.Event()

    async def _reach_version(self, version: int, wait_s: float | None) -> None:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while self._version < version:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise VersionNotReached(f"the weights are at version {self._version}; min_weight_version {version} "
                                        "was not reached in time")
            try:
                await asyncio.wait_for(self._version_changed.wait(), left)
            except TimeoutError:
                pass

    # ---- generation -------------------------------------------------------------------------------------------
    def _vllm_params(self, p: SamplingParams, index: int) -> Any:
        from vllm import SamplingParams as VSP  # lazy: vLLM is optional (its own environment)
        from vllm.sampling_params import RequestOutputKind  # lazy: vLLM is optional

        return VSP(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
                   stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
                   seed=None if p.seed is None else p.seed + index,  # n choices: n different streams
                   logprobs=p.top_logprobs, detokenize=False, output_kind=RequestOutputKind.DELTA)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       stream: bool = True, min_version: int = 0,
                       version_wait_s: float | None = None) -> AsyncIterator[TokenEvent]:
        """n choices = n vLLM requests (vLLM's prefix cache shares the prompt); events merged as they come. A request
        with `min_version` waits here until an update brings those weights (VersionNotReached after
        `version_wait_s`). `stream` is accepted for the built-in engine's signature: tokens' versions are read while
        they stream."""
        params.check(self.max_batch)
        await self._reach_version(min_version, version_wait_s)
        queue: asyncio.Queue = asyncio.Queue()
        sub_ids = [f"{request_id}-{i}-{uuid.uuid4().hex[:6]}" for i in range(params.n)]
        self._live[request_id] = sub_ids

        async def one(i: int) -> None:
            try:
                async for ev in self._choice(sub_ids[i], i, prompt_ids, params):
                    queue.put_nowait(ev)
            except Exception as e:  # forwarded to the consumer
                queue.put_nowait(e)

        tasks = [asyncio.ensure_future(one(i)) for i in range(params.n)]
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finish_reason is not None
                yield item
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()  # cancelling vLLM's generate() aborts the request in the engine
            self._live.pop(request_id, None)

    async def _choice(self, sub_id: str, index: int, prompt_ids: list[int], params: SamplingParams):
        vsp = self._vllm_params(params, index)
        done = 0  # output tokens already emitted
        pending: list[tuple[int, float, Any]] = []  # tokens whose version is not known yet
        async for out in self.llm.generate({"prompt_token_ids": list(prompt_ids)}, vsp, sub_id):
            c = out.outputs[0]
            for k, tid in enumerate(c.token_ids):
                lp = c.logprobs[k] if c.logprobs else None
                pending.append((int(tid), *_logprob_of(lp, int(tid), params.top_logprobs)))
            finished = c.finish_reason is not None
            spans = c.weight_versions if finished else self._spans(sub_id)
            emit = len(pending) if (spans is not None or not pending) else 0
            for j in range(emit):
                tid, lp, tops = pending[j]
                last = finished and j == len(pending) - 1
                yield TokenEvent(index=index, token_id=tid, logprob=lp, version=_at(spans, done + j, self.version),
                                 top_logprobs=tops, finish_reason=_finish(c.finish_reason) if last else None)
            done += emit
            self.generated_tokens += emit
            pending = pending[emit:]
            if finished and emit == 0:  # finished with no new token (e.g. aborted)
                yield TokenEvent(index, -1, 0.0, self.version, None, _finish(c.finish_reason))
            if finished:
                return

    def _spans(self, sub_id: str) -> list[tuple[int, int]] | None:
        """(start index, version) of every weight version seen so far by this live request."""
        op = self.llm.output_processor
        for internal in op.external_req_ids.get(sub_id, ()):
            st = op.request_states.get(internal)
            if st is not None:
                return [(start, _version_int(v)) for v, start in st.weight_version_starts]
        return None

    def abort(self, request_id: str) -> None:
        ids = self._live.get(request_id)
        if ids:
            asyncio.ensure_future(self.llm.abort(ids))

    # ---- facts ------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        running = self.llm.output_processor.get_num_unfinished_requests()
        return dict(running=running, waiting=0, batch_occupancy=running / max(self.max_batch, 1),
                    version=self.version, generated_tokens_total=self.generated_tokens,
                    paused_seconds_total=self.paused_seconds, steps=0)


def _at(spans: Any, i: int, default: int) -> int:
    """Version of output token i, from live spans [(start, version)] or vLLM's final WeightVersionSpan list."""
    if not spans:
        return default
    best = None
    for s in spans:
        start, v = (s[0], s[1]) if isinstance(s, tuple) else (s.start, _version_int(s.version))
        if start <= i:
            best = v
    return default if best is None else best


def _logprob_of(lp: Any, tid: int, k: int) -> tuple[float, list[tuple[int, float]] | None]:
    """vLLM gives {token_id: Logprob(logprob, rank)} holding the sampled token plus the top k (rank 1..k)."""
    if not lp:
        return 0.0, None
    chosen = float(lp[tid].logprob) if tid in lp else float("nan")
    tops = None
    if k > 0:
        ranked = sorted(((v.rank, t, float(v.logprob)) for t, v in lp.items() if v.rank is not None and v.rank <= k))
        tops = [(t, v) for _, t, v in ranked]
    return chosen, tops


def _finish(reason: Any) -> str:
    r = str(reason)
    return r if r in ("stop", "length", "abort") else "abort"
