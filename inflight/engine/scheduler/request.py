"""One chat/completion request inside the server: its n choices as the engine samples them (token ids, logprobs,
versions), their text with stop strings cut off, the part of it that is safe to stream, and its timings for the
server's metrics (api/metrics.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Protocol


class Choice:
    """One choice being generated: raw tokens as sampled, plus text with stop strings cut off."""

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.versions: list[int] = []
        self.constrained: list[bool] = []  # per token: drawn from its grammar's masked distribution
        self.raw_logprobs: list[float | None] = []  # per token: a constrained one's logprob without the mask
        self.finish_reason: str | None = None
        self.text = ""
        self.sent = 0  # characters already streamed
        self.first_token = self.last_token = 0.0  # when its first and last tokens were sampled (time.monotonic)
        self.final_version = 0  # the version of the weights when it ended (the event that ended it)


class GenerationMetrics(Protocol):
    """What a Generation reports as its events come (api/metrics.py `ServerMetrics`)."""

    def scheduled(self, gen: Generation) -> None: ...  # the engine started it (gen.scheduled)

    def first_token(self, gen: Generation) -> None: ...  # its first token (gen.first_token)

    def finished(self, gen: Generation) -> None: ...  # every choice ended (gen.ended), the reply is complete


class Generation:
    """Drives one engine request (n choices) and applies stop strings on the decoded text."""

    def __init__(self, engine: Any, prompt_ids: list[int], params: Any, stops: list[str], n: int, want_text: bool,
                 min_version: int = 0, version_wait_s: float | None = None, arrival: float | None = None,
                 metrics: GenerationMetrics | None = None):
        self.engine, self.prompt_ids, self.params, self.stops = engine, prompt_ids, params, stops
        self.metrics = metrics
        # time.monotonic() when the server took the request, when the engine first scheduled it (the engine's stamp,
        # if it gives one), its first token, and when its last choice ended (None: not (yet) there)
        self.arrival = time.monotonic() if arrival is None else arrival
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.ended: float | None = None
        self.gate = {"min_version": min_version, "version_wait_s": version_wait_s} if min_version else {}
        self.rid = uuid.uuid4().hex
        self.choices = [Choice(i) for i in range(n)]
        self.prompt_scores: Any = None  # prompt_scores.PromptScores, when the request scores its prompt
        self.incremental = bool(stops) or want_text  # decode after every token (stops / streaming)
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars that may start a stop string

    async def events(self) -> AsyncIterator[Choice]:
        """Yields the choice each engine event updated; aborts the engine request when done or cancelled."""
        live = len(self.choices)  # choices still wanted by the client
        engine_live = set(range(len(self.choices)))  # choices the engine has not finished
        try:
            # without stop strings or streaming nothing is needed before the end: the engine hands it all at once
            async for ev in self.engine.generate(self.rid, self.prompt_ids, self.params, stream=self.incremental,
                                                 **self.gate):
                ch = self.choices[ev.index]
                if ev.prompt is not None:
                    self.prompt_scores = ev.prompt
                if ev.scheduled is not None:
                    self._scheduled(ev.scheduled)
                if ev.finish_reason is not None:
                    engine_live.discard(ev.index)
                if ch.finish_reason is not None:
                    continue  # already cut by a stop string
                if ev.token_id >= 0:
                    self._token_time(ch, ev.time or time.monotonic())  # no stamp from the engine: when it came
                    ch.token_ids.append(ev.token_id)
                    ch.logprobs.append(float(ev.logprob))
                    ch.versions.append(int(ev.version))
                    ch.constrained.append(ev.constrained)
                    ch.raw_logprobs.append(ev.raw_logprob)
                    if ev.top_logprobs is not None:
                        ch.tops.append([(int(t), float(v)) for t, v in ev.top_logprobs])
                    if self.incremental:
                        self._update_text(ch)
                if ev.finish_reason is not None and ch.finish_reason is None:
                    ch.finish_reason = ev.finish_reason
                if ch.finish_reason is not None:
                    live -= 1
                    ch.final_version = int(ev.version)
                    if not self.incremental:
                        ch.text = self.engine.tokenizer.decode(ch.token_ids, skip_special_tokens=True)
                yield ch
                if live == 0:
                    break
            self.ended = time.monotonic()
            if self.metrics is not None:
                self.metrics.finished(self)
        finally:
            if engine_live:  # stop strings hit, or the client went away
                self.engine.abort(self.rid)

    def _scheduled(self, t: float) -> None:
        self.scheduled = t
        if self.metrics is not None:
            self.metrics.scheduled(self)

    def _token_time(self, ch: Choice, t: float) -> None:
        if not ch.token_ids:
            ch.first_token = t
        ch.last_token = t
        if self.first_token is None:
            self.first_token = t
            if self.metrics is not None:
                self.metrics.first_token(self)

    def _update_text(self, ch: Choice) -> None:
        text = self.engine.tokenizer.decode(ch.token_ids, skip_special_tokens=True)
        if self.stops:
            start = max(0, len(ch.text) - self.hold)
            cuts = [i for s in self.stops if (i := text.find(s, start)) >= 0]
            if cuts:
                ch.text = text[: min(cuts)]
                ch.finish_reason = "stop"
                return
        ch.text = text

    def stream_delta(self, ch: Choice) -> str:
        """Text that is safe to send now (not a possible start of a stop string, not a partial character)."""
        end = len(ch.text) if ch.finish_reason is not None else len(ch.text) - self.hold
        if ch.finish_reason is None and ch.text.endswith("\ufffd"):
            end = min(end, len(ch.text) - 1)
        if end <= ch.sent:
            return ""
        delta, ch.sent = ch.text[ch.sent:end], end
        return delta
