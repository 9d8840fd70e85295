"""Sequence packing: whole samples laid end to end in one row per micro-batch, under a token budget.

Packing removes padding: a micro-batch of samples of mixed lengths costs sum(len) tokens instead of
n * max(len). Attention must then never cross samples (the trainer builds a block-diagonal causal mask, or uses
varlen flash attention), and positions restart at 0 for every sample.

Per-token layout (see contracts.TrainBatch): index t describes the prediction of input_ids[t] from the tokens
before it in the same sample. So the first token of every sample is never trained (nothing predicts it), and
completion token j of a sample with prompt length P sits at index P + j with its behaviour logprob mu_j. The
tokens of a multi-turn episode that an environment inserted (Sample.loss_mask 0) sit in the row as context, with
loss_mask 0.

`pad_samples` is the plain padded collation, used only by bench/trainer.py for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.contracts import Sample, TrainBatch


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to <= budget; longest first, each into the first bin it fits.
    An item longer than the budget gets a bin of its own. Within a bin, indices keep arrival order."""
    if budget <= 0:
        raise ValueError(f"token budget must be positive, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return [sorted(b) for b in bins]


def completion_mask(s: Sample) -> list[int]:
    """1 per completion token the model sampled, 0 per environment token (Sample.loss_mask; None = all 1)."""
    return [1] * len(s.completion_ids) if s.loss_mask is None else [1 if m else 0 for m in s.loss_mask]


def count_loss_tokens(samples: list[Sample]) -> int:
    """Trained tokens of these samples (what `num_tokens_in_step` counts): the model's completion tokens (not an
    environment's), minus a sample's first token when its prompt is empty."""
    n = 0
    for s in samples:
        m = completion_mask(s)
        n += sum(m) - (m[0] if not s.prompt_ids and m else 0)
    return n


def _check(sample: Sample, with_versions: bool) -> None:
    if len(sample) == 0:
        raise ValueError(f"sample of group {sample.group_id!r} has no tokens")
    if with_versions:
        n = len(sample.completion_ids)
        if len(sample.logprobs) != n or len(sample.versions) != n:
            raise ValueError(
                f"sample of group {sample.group_id!r}: {n} completion tokens but {len(sample.logprobs)} logprobs "
                f"and {len(sample.versions)} versions (pass with_versions=False for samples without them)"
            )
    if sample.loss_mask is not None and len(sample.loss_mask) != len(sample.completion_ids):
        raise ValueError(f"sample of group {sample.group_id!r}: {len(sample.completion_ids)} completion tokens but "
                         f"{len(sample.loss_mask)} loss_mask entries")


def completion_slices(samples: list[Sample]) -> list[tuple[int, int]]:
    """[start, end) of each sample's completion tokens in a batch collated from exactly these samples."""
    out, pos = [], 0
    for s in samples:
        out.append((pos + len(s.prompt_ids), pos + len(s)))
        pos += len(s)
    return out


def collate(
    samples: list[Sample],
    advantages: "list[float] | list[float | list[float]]",
    num_samples_in_step: int,
    num_tokens_in_step: int,
    with_versions: bool = True,
    temperature: float = 1.0,
    trained: list[bool] | None = None,
) -> TrainBatch:
    """One packed TrainBatch of exactly these samples, in this order. `advantages[k]`: one value for every completion
    token of sample k, or a list of one per completion token (REINFORCE++). `trained[k]` False: sample k is in the row but
    none of its tokens trains (loss_mask 0), e.g. a truncated completion under algo.truncated=mask."""
    if trained is not None and len(trained) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(trained)} trained flags")
    ids: list[int] = []
    pos: list[int] = []
    mask: list[float] = []
    adv: list[float] = []
    mu: list[float] = []
    ver: list[int] = []
    sidx: list[int] = []
    lens: list[int] = []
    for k, (s, a) in enumerate(zip(samples, advantages, strict=True)):
        _check(s, with_versions)
        p, c = len(s.prompt_ids), len(s.completion_ids)
        n = p + c
        ids += s.prompt_ids + s.completion_ids
        pos += range(n)
        on = 1.0 if trained is None or trained[k] else 0.0
        m = [0.0] * p + [on * x for x in completion_mask(s)]  # an environment's tokens are never trained
        m[0] = 0.0  # nothing in this sample predicts its first token
        mask += m
        if isinstance(a, (list, tuple)):
            if len(a) != c:
                raise ValueError(f"sample {k}: {c} completion tokens but {len(a)} per-token advantages")
            adv += [0.0] * p + [float(x) for x in a]
        else:
            adv += [0.0] * p + [float(a)] * c
        mu += [0.0] * p + (list(s.logprobs) if with_versions else [0.0] * c)
        ver += [-1] * p + (list(s.versions) if with_versions else [-1] * c)
        sidx += [k] * n
        lens.append(n)
    return TrainBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        seq_lens=lens,
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        behaviour_logprobs=torch.tensor(mu, dtype=torch.float32),
        versions=torch.tensor(ver, dtype=torch.long),
        sample_index=torch.tensor(sidx, dtype=torch.long),
        num_samples_in_step=num_samples_in_step,
        num_tokens_in_step=num_tokens_in_step,
        temperature=temperature,
    )


def pack_samples(
    samples: list[Sample],
    advantages: list[float],
    token_budget: int,
    num_samples_in_step: int,
    num_tokens_in_step: int,
    with_versions: bool = True,
    temperature: float = 1.0,
) -> list[TrainBatch]:
    """Pack whole samples into micro-batches of at most `token_budget` tokens (first-fit decreasing; a sample
    longer than the budget gets its own micro-batch). `advantages[i]` belongs to `samples[i]`.
    `with_versions=False` accepts samples without behaviour logprobs / versions (SFT): zeros and -1 are used."""
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    bins = first_fit_decreasing([len(s) for s in samples], token_budget)
    return [
        collate(
            [samples[i] for i in b], [advantages[i] for i in b], num_samples_in_step, num_tokens_in_step,
            with_versions, temperature,
        )
        for b in bins
    ]


@dataclass
class PaddedBatch:
    """The padded (unpacked) alternative: [B, L] right-padded, attention_mask 0 on padding."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L], same convention as TrainBatch.loss_mask, 0 on padding
    advantages: torch.Tensor  # [B, L]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def pad_samples(samples: list[Sample], advantages: list[float], batch_size: int, pad_id: int = 0) -> list[PaddedBatch]:
    """Batches of `batch_size` samples in arrival order, each right-padded to its longest sample."""
    out = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        att = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width))
        adv = torch.zeros((len(chunk), width))
        for r, s in enumerate(chunk):
            p, n = len(s.prompt_ids), len(s)
            ids[r, :n] = torch.tensor(s.prompt_ids + s.completion_ids)
            att[r, :n] = 1
            mask[r, max(p, 1) : n] = 1.0
            adv[r, p:n] = float(advantages[start + r])
        out.append(PaddedBatch(ids, att, mask, adv))
    return out
