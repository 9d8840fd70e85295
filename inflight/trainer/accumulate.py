"""Gradient accumulation over micro-batches packed as samples arrive.

The trainer should not wait for a whole optimizer step's batch: as soon as the buffered samples fill a token
budget, a micro-batch is packed and its backward runs while the actor keeps producing.

    acc = StepAccumulator(trainer, loss_fn, token_budget=4096, num_samples_in_step=64, num_tokens_in_step=None)
    for groups in stream:                 # as they arrive
        acc.add(samples, advantages)      # runs backward on every full micro-batch
    stats = acc.finish()                  # remaining samples, then trainer.optimizer_step()

With several ranks (FSDP2) every rank owns its samples and micro-batches, but forward/backward are collective,
so `add` and `finish` are collective too: every rank calls them the same number of times (possibly with no
samples); ranks agree on the number of micro-batches to run and the ones short of work run an empty one (zero
gradient). All ranks therefore reach the optimizer step together.

`num_tokens_in_step` (token normalisation) is only known once the whole step has arrived; when it is None the
accumulator keeps everything until `finish` (no streaming), and `num_samples_in_step` alone streams.

`prox=True` (decoupled PPO) fills `batch.prox_logprobs` with `forward_logprobs` just before each backward: the
weights only change at the optimizer step, so these are the weights before this step. `ref` (a frozen reference
engine, KL term) fills `batch.ref_logprobs` the same way; with FSDP2 both are collective, like the backward, and run
on the stand-in micro-batch of a rank without work too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from inflight.contracts import LossFn, Sample, TrainBatch
from inflight.trainer.packing import collate, count_loss_tokens, first_fit_decreasing


def empty_batch(num_samples_in_step: int, num_tokens_in_step: int) -> TrainBatch:
    """A one-token micro-batch with nothing to train (a rank's stand-in when it has no work)."""
    b = collate(
        [Sample(group_id="", prompt_ids=[0], completion_ids=[], logprobs=[], versions=[])], [0.0],
        num_samples_in_step, num_tokens_in_step,
    )
    b.prox_logprobs, b.ref_logprobs = torch.zeros(1), torch.zeros(1)  # whatever the loss checks for
    return b


class StepAccumulator:
    def __init__(
        self,
        engine: Any,
        loss_fn: LossFn,
        token_budget: int,
        num_samples_in_step: int,
        num_tokens_in_step: int | None = None,
        with_versions: bool = True,
        temperature: float = 1.0,
        prox: bool = False,
        merge: Callable[[list[dict[str, float]]], dict[str, float]] | None = None,
        ref: Any = None,
    ):
        self.engine, self.loss_fn, self.budget = engine, loss_fn, token_budget
        self.num_samples_in_step, self.num_tokens_in_step = num_samples_in_step, num_tokens_in_step
        self.with_versions, self.temperature, self.prox, self.ref = with_versions, temperature, prox, ref
        self.merge = merge or merge_stats  # e.g. inflight.algo.merge_stats for its loss stats
        self.pending: list[tuple[Sample, float | list[float]]] = []
        self.stats: list[dict[str, float]] = []
        self.world_size = int(getattr(engine, "world_size", 1))
        self.group = getattr(engine, "cpu_group", None)  # counts are CPU tensors: a gloo group (NCCL has none)

    def _pack(self, flush: bool) -> list[TrainBatch]:
        """Micro-batches ready now: when flushing, all; otherwise the full ones (the least-filled bin stays)."""
        n_tokens = self.num_tokens_in_step
        if flush and n_tokens is None:  # flush with unknown token count: everything is here now
            n_tokens = count_loss_tokens([s for s, _ in self.pending])
            if self.world_size > 1:  # collective: a rank with nothing pending adds its 0 (never returns first)
                t = torch.tensor([n_tokens], dtype=torch.long)
                torch.distributed.all_reduce(t, group=self.group)
                n_tokens = int(t)
        if not self.pending:
            return []
        if not flush and (n_tokens is None or sum(len(s) for s, _ in self.pending) < self.budget):
            return []
        assert n_tokens is not None  # counted above when flushing; otherwise a partial pack waited for it
        bins = first_fit_decreasing([len(s) for s, _ in self.pending], self.budget)
        if not flush:
            bins.sort(key=lambda b: sum(len(self.pending[i][0]) for i in b))
            keep, bins = bins[0], bins[1:]
        else:
            keep = []
        out = [
            collate(
                [self.pending[i][0] for i in b], [self.pending[i][1] for i in b], self.num_samples_in_step, n_tokens,
                self.with_versions, self.temperature,
            )
            for b in bins
        ]
        self.pending = [self.pending[i] for i in keep]
        return out

    def _run(self, batches: list[TrainBatch]) -> None:
        n = len(batches)
        if self.world_size > 1:  # agree on the number of collective forward/backward passes
            t = torch.tensor([n], dtype=torch.long)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
            n = int(t)
        for k in range(n):
            real = k < len(batches)
            b = batches[k] if real else empty_batch(self.num_samples_in_step, self.num_tokens_in_step or 1)
            if self.prox:
                b.prox_logprobs = self.engine.forward_logprobs(b)
            if self.ref is not None:
                b.ref_logprobs = self.ref.forward_logprobs(b)
            stats = self.engine.backward(b, self.loss_fn)
            if real:
                self.stats.append(stats)

    def add(self, samples: list[Sample], advantages: list[float] | list[list[float]]) -> None:
        """Buffer these samples; run backward on every micro-batch that is full. An advantage: one for every
        completion token of its sample, or a list of one per completion token (REINFORCE++)."""
        if len(samples) != len(advantages):
            raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
        self.pending += list(zip(samples, advantages))
        self._run(self._pack(flush=False))

    def finish(self, step: bool = True) -> dict[str, float]:
        """Backward on what is left, then (if `step`) the optimizer step. Returns summed token counts, the mean of
        the other per-micro-batch stats, and the optimizer's grad_norm / lr."""
        self._run(self._pack(flush=True))
        out = self.merge(self.stats) if self.stats else {}
        out["micro_batches"] = float(len(self.stats))
        out["batch_tokens"] = sum(s.get("batch_tokens", 0.0) for s in self.stats)
        self.stats = []
        if step:
            out.update(self.engine.optimizer_step())
        return out


def merge_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """Generic: sum `loss` (micro-batch losses of a step add up to the step's), counts and `*_sum`; max `*_max`;
    mean the rest."""
    out: dict[str, float] = {}
    for k in sorted({k for s in stats for k in s}):
        vals = [s[k] for s in stats if k in s]
        if k in ("loss", "tokens", "batch_tokens", "clipped", "masked") or k.endswith("_sum"):
            out[k] = sum(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out
