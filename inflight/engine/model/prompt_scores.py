"""Prompt logprobs: the log-probability of every prompt token given the tokens before it, from the prefill's logits.

Asked for by a request's `prompt_logprobs` (SamplingParams; the server's `echo` + `logprobs` and vLLM's
`prompt_logprobs` field). The logits of prompt position p give token p + 1; the first token has no logprob (None).
Always the raw model distribution: float32 log-softmax at temperature 1, whatever the request samples with, so the
numbers are comparable with an evaluation harness's own forward (vLLM's default too).

The engine scores a prompt chunk by chunk as it prefills it (a chunked prefill spans several steps) and records
the weight version of each chunk's forward. A request that asks for them never reuses a retained prefix (the
positions it would skip have no logits), and an `interrupt` update that re-prefills it starts the scores again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# prompt positions scored per engine step and request: bounds the [rows, vocab] float32 logits a long prompt needs
# (512 x 152k vocabulary = 300 MB) where a prefill chunk would otherwise be max_tokens_per_step long
MAX_ROWS = 512


@dataclass
class PromptScores:
    """One entry per prompt token, the first None: logprob, rank (1 = the most likely token), the top-k
    alternatives [(token id, logprob)] most likely first, and the weight version of the forward that scored it."""

    prompt: list[int]
    k: int  # alternatives per position (0: only the prompt token's own logprob and rank)
    logprobs: list[float | None] = field(default_factory=lambda: [None])
    ranks: list[int | None] = field(default_factory=lambda: [None])
    tops: list[list[tuple[int, float]] | None] = field(default_factory=lambda: [None])
    versions: list[int | None] = field(default_factory=lambda: [None])

    @property
    def next_position(self) -> int:
        """The prompt position whose logits are needed next (position p scores token p + 1)."""
        return len(self.logprobs) - 1

    @property
    def complete(self) -> bool:
        return len(self.logprobs) == len(self.prompt)

    def clear(self) -> None:
        """Start again (a re-prefill after an `interrupt` update scores the prompt with the new weights)."""
        self.logprobs, self.ranks, self.tops, self.versions = [None], [None], [None], [None]

    def wanted(self, start: int, length: int) -> int:
        """How many rows of a prefill chunk at positions [start, start + length) score prompt tokens (0 if none)."""
        if start != self.next_position:
            return 0
        return max(0, min(start + length, len(self.prompt) - 1) - start)

    def add(self, logits: torch.Tensor, version: int) -> None:
        """`logits` [m, V]: the rows of positions next_position .. next_position + m - 1."""
        start, m = self.next_position, logits.shape[0]
        targets = torch.tensor(self.prompt[start + 1 : start + 1 + m], dtype=torch.long, device=logits.device)
        logp = torch.log_softmax(logits.float(), dim=-1)
        own = logp.gather(1, targets[:, None])
        # rank: how many tokens are at least as likely as the prompt token (1 = the argmax)
        ranks = (logp >= own).sum(-1)
        self.logprobs += own[:, 0].tolist()
        self.ranks += ranks.tolist()
        if self.k:
            vals, ids = logp.topk(min(self.k, logp.shape[-1]), dim=-1)
            self.tops += [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        else:
            self.tops += [[] for _ in range(m)]
        self.versions += [version] * m


def feed(logits: torch.Tensor, scores: list[PromptScores | None], rows: list[int], n_sample: int,
         version: int) -> torch.Tensor:
    """A step's logits: the first n_sample rows are for sampling, then rows[i] rows scoring chunk i's prompt
    positions (StepPlan.out_rows). Feeds those to scores[i]; returns the sampling rows."""
    off = n_sample
    for sc, m in zip(scores, rows):
        if m and sc is not None:
            sc.add(logits[off : off + m], version)
            off += m
    return logits[:n_sample]
