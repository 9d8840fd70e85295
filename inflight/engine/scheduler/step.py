"""What one engine step computes, once the scheduler (core.py) has chosen its chunks: the StepPlan a model runner
reads (shared by the fast llama path and the HF fallback), the forward, and the sampling of the next tokens.

A step feeds every scheduled sequence a chunk of its not-yet-cached tokens: one token for a decoding sequence,
up to the token budget for a (re-)prefill. All chunks are concatenated into one flat token tensor; decode chunks
come first so the runner can attend for them in one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from inflight.engine.model import prompt_scores
from inflight.engine.model.cpu_kernels import Kernels
from inflight.engine.model.device_sampling import CONTINUE, LENGTH, STOP, DeviceSampler
from inflight.engine.model.grammar import Grammars, advance
from inflight.engine.model.graph_runner import DecodeGraphs
from inflight.engine.model.sampling import sample
from inflight.engine.scheduler.sequence import Seq, TokenEvent

Chunk = tuple[int, int, list[int]]  # (KV slot, start position, token ids) of one sequence in a step
_FINISH = {CONTINUE: None, STOP: "stop", LENGTH: "length"}


class Runner(Protocol):
    """What a step needs of a model runner (llama_runner.LlamaRunner, hf_runner.HFRunner)."""

    @property
    def kernels(self) -> Kernels | None: ...  # the C kernels, sampling included, where they run

    def forward(self, plan: StepPlan) -> torch.Tensor: ...

    def copy_slot(self, src: int, dst: int, length: int) -> None: ...


@dataclass
class StepPlan:
    tokens: torch.Tensor  # [N] int64, all chunks concatenated (decodes first)
    positions: torch.Tensor  # [N] int64, position of each token in its sequence
    token_slots: torch.Tensor  # [N] int64, KV-cache slot of each token's sequence
    num_decode: int  # the first num_decode tokens are single-token decodes (one per sequence)
    lens: torch.Tensor  # [N] int64, length of each token's sequence up to and including it (= position + 1)
    prefills: list[tuple[int, int, int, int]]  # (slot, start position, chunk length, offset in tokens)
    out_rows: torch.Tensor  # [R] int64, flat rows whose next-token logits are wanted: sampling order, then the
    # rows of prompt positions being scored (prompt_scores.py), chunk by chunk
    max_decode_len: int = 0  # max(lens[:num_decode]), known on the host without a sync
    max_len: int = 0  # max(positions) + 1 over all tokens, likewise
    decode_first_slot: int | None = None  # set when the decode slots are first, first+1, ... (no gather needed)

    @staticmethod
    def build(chunks: list[Chunk], want_logits: list[bool], device: torch.device,
              score: list[int] | None = None) -> "StepPlan":
        """chunks: (slot, start position, token ids) per sequence, decodes (one token) first. score[i]: the first
        score[i] rows of chunk i are wanted too (prompt logprobs), after the sampling rows."""
        toks: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        out: list[int] = []
        scored: list[int] = []
        prefills: list[tuple[int, int, int, int]] = []
        num_decode = 0
        max_decode_len = max_len = 0
        for i, ((slot, start, ids), want) in enumerate(zip(chunks, want_logits)):
            off = len(toks)
            c = len(ids)
            max_len = max(max_len, start + c)
            if c == 1 and not prefills and start > 0:
                num_decode += 1
                max_decode_len = max(max_decode_len, start + 1)
            else:
                prefills.append((slot, start, c, off))
            toks.extend(ids)
            pos.extend(range(start, start + c))
            slots.extend([slot] * c)
            if want:
                out.append(off + c - 1)
            if score and score[i]:
                scored.extend(range(off, off + score[i]))
        positions = torch.tensor(pos, dtype=torch.long)
        first = slots[0] if num_decode and slots[:num_decode] == list(range(slots[0], slots[0] + num_decode)) else None
        return StepPlan(
            tokens=torch.tensor(toks, dtype=torch.long, device=device),
            positions=positions.to(device),
            token_slots=torch.tensor(slots, dtype=torch.long, device=device),
            num_decode=num_decode,
            lens=(positions + 1).to(device),
            prefills=prefills,
            out_rows=torch.tensor(out + scored, dtype=torch.long, device=device),
            max_decode_len=max_decode_len,
            max_len=max_len,
            decode_first_slot=first,
        )


def forward(runner: Runner, graphs: DecodeGraphs | None, device: torch.device, chunks: list[Chunk],
            want: list[bool], nd: int, score: list[int], seqs: list[Seq],
            version: int) -> tuple[torch.Tensor, list[int], list[Seq]]:
    """The forward over a step's chunks, one per sequence of `seqs`: nd: the first nd chunks are decodes (one token
    after a cached prefix, logits wanted; all decodes: a graph replay where `graphs` is set); want[i]: chunk i's
    last row is sampled; score[i]: rows of chunk i that score prompt tokens (fed to the sequence's scores).
    Advances each sequence's cached length, and once choice 0 has prefilled a shared prompt copies its KV to the
    other choices (which start sampling from the same row). Returns (the sampling rows' logits, for each sequence
    to sample its row in them, those sequences)."""
    if graphs is not None and nd == len(chunks):
        logits = graphs.decode([ids[0] for _, _, ids in chunks], [start for _, start, _ in chunks],
                               [slot for slot, _, _ in chunks])
    else:  # prefill chunks (or no graphs): the eager forward
        logits = runner.forward(StepPlan.build(chunks, want, device, score))
    if any(score):
        logits = prompt_scores.feed(logits, [s.scores for s in seqs], score, sum(want), version)
    rows: list[int] = []
    sampled: list[Seq] = []
    r = 0
    for s, (_, _, ids), w in zip(seqs, chunks, want):
        s.num_cached += len(ids)
        if not w:
            continue
        if s.split_pending:  # choice 0 prefilled the shared prompt: copy its KV to the other choices
            s.split_pending = False
            for c in s.req.seqs[1:]:
                if not c.done:
                    runner.copy_slot(s.slot, c.slot, s.num_cached)
                    c.num_cached, c.kv_version, c.active = s.num_cached, s.kv_version, True
                    rows.append(r)
                    sampled.append(c)
        rows.append(r)
        sampled.append(s)
        r += 1
    return logits, rows, sampled


def sample_next(logits: torch.Tensor, seqs: list[Seq], rng: torch.Generator, sampler: DeviceSampler | None,
                kernels: Kernels | None, max_model_len: int, version: int,
                grammars: Grammars | None = None) -> list[TokenEvent]:
    """The next token of each of `seqs` (row i of `logits` for seqs[i]), appended to it, and its event; the event's
    finish_reason is set when the sequence ends with it (a stop id, max_tokens, the context is full, or its grammar
    is complete). Constrained sequences (a matcher) sample from their row masked by `grammars` (grammar.py), the
    others from theirs as it is. Seeded sequences draw from their own generator, the others from `rng`. Choice 0's
    first event carries its prompt scores."""
    ps = [s.req.params for s in seqs]
    constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
    raw_rows = None  # the constrained rows' logprobs without the mask
    if constrained:
        assert grammars is not None, "a constrained sequence needs the engine's grammars"
        raw_rows = raw_logprobs(logits, constrained, [ps[i].temperature for i in constrained])
        grammars.mask_logits(logits, constrained, [seqs[i].matcher for i in constrained])
    dev = logits.device
    u = torch.rand(len(seqs), generator=rng)
    for i, s in enumerate(seqs):
        if s.gen is not None:
            u[i] = torch.rand(1, generator=s.gen)[0]
    filtered = any(p.temperature > 0 and (p.top_p < 1 or p.top_k > 0) for p in ps)
    num_top = max(p.top_logprobs for p in ps)
    codes = None
    if sampler is not None:  # on the device: one copy back per step, stop checks included
        tok_l, lp_l, codes, top_v, top_i = sampler.run(logits, seqs, u.tolist(), filtered, num_top)
    else:
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev)
        tokens, logprobs, top = sample(logits, temp, top_p, top_k, u.to(dev), num_top, filtered, kernels)
        tok_l, lp_l = tokens.tolist(), logprobs.tolist()
        top_v, top_i = (top[0].tolist(), top[1].tolist()) if top is not None else (None, None)
    raw: dict[int, float] = {}  # constrained row -> its token's raw logprob
    if raw_rows is not None:
        picked = torch.tensor([tok_l[i] for i in constrained], device=raw_rows.device)
        raw = dict(zip(constrained, raw_rows.gather(1, picked[:, None])[:, 0].tolist()))
    events = []
    for i, (s, tok, lp, p) in enumerate(zip(seqs, tok_l, lp_l, ps)):
        s.tokens.append(tok)
        s.n_gen += 1
        tl = None
        if p.top_logprobs:
            assert top_i is not None and top_v is not None  # num_top >= p.top_logprobs > 0
            tl = [(t, v) for t, v in zip(top_i[i][: p.top_logprobs], top_v[i][: p.top_logprobs]) if v > -1e30]
        reason = None
        if codes is not None:
            reason = _FINISH[codes[i]]
        elif tok in s.req.stop_ids:
            reason = "stop"
        elif s.n_gen >= p.max_tokens or len(s.tokens) >= max_model_len:
            reason = "length"
        if s.matcher is not None and advance(s.matcher, tok):
            reason = "stop"  # the grammar is complete (or could not go on)
        ev = TokenEvent(s.index, tok, lp, version, tl, reason, constrained=s.matcher is not None,
                        raw_logprob=raw.get(i))
        if s.scores is not None:  # choice 0's first token: its prompt is scored by now
            ev.prompt, s.scores = s.scores, None
        events.append(ev)
    return events


def raw_logprobs(logits: torch.Tensor, rows: list[int], temperature: list[float]) -> torch.Tensor:
    """log_softmax(logits / temperature) of `rows` (temperature 1 where greedy), before any grammar mask: a
    constrained token's raw logprob, what the model alone gave it (top-k / top-p not applied)."""
    t = torch.tensor([x if x > 0 else 1.0 for x in temperature], dtype=torch.float32, device=logits.device)
    return torch.log_softmax(logits[torch.tensor(rows, device=logits.device)].float() / t[:, None], dim=-1)
