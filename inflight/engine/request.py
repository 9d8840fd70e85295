"""One chat/completion request inside the server: its n choices as the engine samples them (token ids, logprobs,
versions), their text with stop strings cut off, and the part of it that is safe to stream."""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator


class Choice:
    """One choice being generated: raw tokens as sampled, plus text with stop strings cut off."""

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.text = ""
        self.sent = 0  # characters already streamed


class Generation:
    """Drives one engine request (n choices) and applies stop strings on the decoded text."""

    def __init__(self, engine: Any, prompt_ids: list[int], params: Any, stops: list[str], n: int, want_text: bool,
                 min_version: int = 0, version_wait_s: float | None = None):
        self.engine, self.prompt_ids, self.params, self.stops = engine, prompt_ids, params, stops
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
                if ev.finish_reason is not None:
                    engine_live.discard(ev.index)
                if ch.finish_reason is not None:
                    continue  # already cut by a stop string
                if ev.token_id >= 0:
                    ch.token_ids.append(ev.token_id)
                    ch.logprobs.append(float(ev.logprob))
                    ch.versions.append(int(ev.version))
                    if ev.top_logprobs is not None:
                        ch.tops.append([(int(t), float(v)) for t, v in ev.top_logprobs])
                    if self.incremental:
                        self._update_text(ch)
                if ev.finish_reason is not None and ch.finish_reason is None:
                    ch.finish_reason = ev.finish_reason
                if ch.finish_reason is not None:
                    live -= 1
                    if not self.incremental:
                        ch.text = self.engine.tokenizer.decode(ch.token_ids, skip_special_tokens=True)
                yield ch
                if live == 0:
                    break
        finally:
            if engine_live:  # stop strings hit, or the client went away
                self.engine.abort(self.rid)

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
