"""Which sequences one engine step feeds, and how much of each (core.py runs the step, step.py computes it).

Decodes first, one token each, in slot order; then prompt and re-prefill chunks within the step's token budget,
most urgent first (`SamplingParams.priority`, then arrival). Sequences of a lower priority (priority > 0: held-out
evaluation) prefill at most `low_prefill` tokens per step, so a burst of their distinct prompts never makes one long
step that the rollouts' decodes and a weight update (paused at the next step boundary) wait behind; and while
`hold` (a weight update on its way) they take no part at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.engine.model import prompt_scores
from inflight.engine.scheduler.sequence import Seq
from inflight.engine.scheduler.step import Chunk


@dataclass
class Choice:
    chunks: list[Chunk] = field(default_factory=list)  # decodes first, then prefill chunks
    want: list[bool] = field(default_factory=list)  # per chunk: its last position's logits are sampled from
    score: list[int] = field(default_factory=list)  # per chunk: prompt positions whose logprobs are wanted
    seqs: list[Seq] = field(default_factory=list)
    decodes: int = 0
    prefill_tokens: int = 0  # prompt tokens this step computes (a reused prefix's last one, fed as a decode, too)


def choose(running: list[Seq], budget: int, version: int, low_prefill: int, hold: bool) -> Choice:
    """The step's chunks. A sequence whose prefill starts here gets KV of `version` (and its prompt scores, after
    an `interrupt` update, start again)."""
    ch = Choice()
    decodes = [s for s in running if s.active and s.num_cached > 0 and len(s.tokens) - s.num_cached == 1
               and not (hold and s.req.params.priority > 0)]
    for s in sorted(decodes, key=lambda s: s.slot)[:budget]:
        ch.chunks.append((s.slot, s.num_cached, s.tokens[-1:]))
        ch.want.append(True)
        ch.score.append(0)
        ch.seqs.append(s)
        ch.prefill_tokens += s.n_gen == 0  # a reused prefix's last prompt token
    ch.decodes = len(ch.seqs)
    budget -= ch.decodes
    low = low_prefill
    for s in sorted(running, key=lambda s: s.req.params.priority):
        pending = len(s.tokens) - s.num_cached
        if budget > 0 and s.active and (pending > 1 or s.num_cached == 0):
            c = min(pending, budget, prompt_scores.MAX_ROWS if s.scores is not None else budget)
            if s.req.params.priority > 0:
                if low <= 0 or hold:
                    continue
                c = min(c, low)
                low -= c
            if s.num_cached == 0:
                s.kv_version = version
                if s.scores is not None:
                    s.scores.clear()  # a re-prefill (interrupt update) scores with the new weights
            ch.chunks.append((s.slot, s.num_cached, s.tokens[s.num_cached : s.num_cached + c]))
            ch.want.append(c == pending)
            ch.score.append(s.scores.wanted(s.num_cached, c) if s.scores is not None else 0)
            ch.seqs.append(s)
            budget -= c
            ch.prefill_tokens += c
    return ch
