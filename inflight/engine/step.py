"""What one engine step asks a model runner to compute (shared by the fast llama path and the HF fallback).

A step feeds every scheduled sequence a chunk of its not-yet-cached tokens: one token for a decoding sequence,
up to the token budget for a (re-)prefill. All chunks are concatenated into one flat token tensor; decode chunks
come first so the runner can attend for them in one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    def build(chunks: list[tuple[int, int, list[int]]], want_logits: list[bool], device: torch.device,
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
        first = slots[0] if num_decode else None
        if num_decode and slots[:num_decode] != list(range(first, first + num_decode)):
            first = None
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
