"""Shared test helpers: random samples and a plain REINFORCE loss written here (independent of inflight.algo)."""

from __future__ import annotations

import random

import torch

from inflight.contracts import Sample, TrainBatch


def random_samples(n: int, vocab: int, seed: int, min_len: int = 2, max_len: int = 24) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(0, 6) if i % 4 else 0  # some samples without a prompt
        c = rng.randint(max(1, min_len - p), max_len)
        out.append(
            Sample(
                group_id=f"g{i // 4}",
                prompt_ids=[rng.randrange(4, vocab) for _ in range(p)],
                completion_ids=[rng.randrange(4, vocab) for _ in range(c)],
                logprobs=[-rng.random() for _ in range(c)],
                versions=[rng.randint(0, 3) for _ in range(c)],
            )
        )
    return out


class ReinforceLoss:
    """-sum_t A_t * logpi_t * mask_t / num_samples_in_step (sequence normalisation), plus entropy stats."""

    def __init__(self, needs_entropy: bool = False, entropy_coef: float = 0.0):
        self.needs_entropy = needs_entropy
        self.entropy_coef = entropy_coef

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None):
        m = batch.loss_mask
        loss = -(batch.advantages * logprobs * m).sum() / batch.num_samples_in_step
        if entropy is not None:
            loss = loss - self.entropy_coef * (entropy * m).sum() / batch.num_samples_in_step
        return loss, {"pg_loss": float(loss.detach())}
