"""Sampling on the model's device without a host sync until the step's results are needed (the CUDA path).

`sample_rows` is sampling.sample's contract (see there: the logprob is under the distribution sampled from, after
temperature and top-k/top-p renormalisation; greedy rows get the temperature-1 logprob) written as batched tensor
ops with no host-side branch on device values: greedy and sampled rows are computed together and chosen with
torch.where; only `filtered` and `num_top`, known on the host from the requests, skip work. The uniform numbers come
from the host (seeded rows draw from their own generator, as on CPU), so a seeded request gives the same tokens on
either sampler up to float rounding of the logits.

`finish_codes` is the stop check on the device: a stop token (per-row table of stop ids, -1 padded), else the
length limits. `DeviceSampler.run` does a step: one host->device copy of the rows' integers, one of their floats,
the sampling and the stop check, and everything the host needs packed into one float64 tensor, copied back
asynchronously into pinned memory, then one wait for that copy (instead of one sync per value or sequence).
"""

from __future__ import annotations

import torch

from inflight.engine.model.sampling import top_p_top_k

CONTINUE, STOP, LENGTH = 0, 1, 2  # finish codes


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                u: torch.Tensor, filtered: bool, num_top: int = 0):
    """logits [B, V]; temperature, top_p [B] float32; top_k [B] int64 (0 = off); u [B] in [0, 1).
    Returns (tokens [B] int64, logprobs [B] float32, (top values, top ids) [B, num_top] or None)."""
    logits = logits.float()
    B, V = logits.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    if filtered:  # greedy rows keep every token: their logprob is the plain temperature-1 one
        logp = top_p_top_k(logp, greedy, top_p, top_k)
    cdf = logp.exp().cumsum(-1)  # zero-probability tokens leave it flat: the search never lands on them
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=V - 1)
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    logprobs = logp.gather(1, tokens[:, None])[:, 0]
    top = logp.topk(min(num_top, V), dim=-1) if num_top > 0 else None
    return tokens, logprobs, (None if top is None else (top.values, top.indices))


def finish_codes(tokens: torch.Tensor, stops: torch.Tensor, n_gen: torch.Tensor, max_tokens: torch.Tensor,
                 seq_len: torch.Tensor, max_model_len: int) -> torch.Tensor:
    """STOP where the token is one of its row's stop ids (stops [B, S], -1 padded), else LENGTH where the row has
    now generated max_tokens or filled the context, else CONTINUE. n_gen, seq_len: before this token."""
    stop = (tokens[:, None] == stops).any(-1)
    length = (n_gen + 1 >= max_tokens) | (seq_len + 1 >= max_model_len)
    return torch.where(stop, STOP, torch.where(length, LENGTH, CONTINUE))


class DeviceSampler:
    """Host staging buffers sized for max_batch rows (pinned on CUDA), reused every step."""

    def __init__(self, max_batch: int, device: torch.device, max_model_len: int, max_stops: int = 8):
        self.device, self.max_model_len = torch.device(device), max_model_len
        self._allocate(max_batch, max_stops)

    def _allocate(self, max_batch: int, max_stops: int) -> None:
        pin = self.device.type == "cuda"
        self.max_stops = max_stops
        self._ints = torch.zeros(max_batch, 4 + max_stops, dtype=torch.long)  # top_k, n_gen, max_tokens, len, stops
        self._floats = torch.zeros(max_batch, 3, dtype=torch.float32)  # temperature, top_p, u
        self._out = torch.zeros(max_batch * (3 + 40), dtype=torch.float64)  # results, then top logprobs
        if pin:
            self._ints, self._floats, self._out = (t.pin_memory() for t in (self._ints, self._floats, self._out))
        self._ints_d = self._ints.to(self.device)
        self._floats_d = self._floats.to(self.device)
        self._event = torch.cuda.Event() if pin else None

    def run(self, logits: torch.Tensor, seqs: list, u: list[float], filtered: bool,
            num_top: int) -> tuple[list[int], list[float], list[int], list | None, list | None]:
        """One token for each of `seqs` (sequence.Seq, before this token), u: their uniform numbers. Returns
        (tokens, logprobs, finish codes, top values, top ids) as host lists."""
        B = logits.shape[0]
        ps = [s.req.params for s in seqs]
        ints = [[p.top_k, s.n_gen, p.max_tokens, len(s.tokens), *s.req.stop_ids] for s, p in zip(seqs, ps)]
        floats = [[p.temperature, p.top_p, x] for p, x in zip(ps, u)]
        S = max(1, max(len(r) for r in ints) - 4)
        if S > self.max_stops:  # a request with more stop ids than the table has room for: grow it once
            self._allocate(self._floats.shape[0], S)
        w = 4 + S
        self._ints[:B, :w] = torch.tensor([r + [-1] * (w - len(r)) for r in ints], dtype=torch.long)
        self._floats[:B] = torch.tensor(floats, dtype=torch.float32)
        ints_d, floats_d = self._ints_d[:B, :w], self._floats_d[:B]
        ints_d.copy_(self._ints[:B, :w], non_blocking=True)
        floats_d.copy_(self._floats[:B], non_blocking=True)
        tokens, logprobs, top = sample_rows(logits, floats_d[:, 0], floats_d[:, 1], ints_d[:, 0], floats_d[:, 2],
                                            filtered, num_top)
        codes = finish_codes(tokens, ints_d[:, 4:], ints_d[:, 1], ints_d[:, 2], ints_d[:, 3], self.max_model_len)
        parts = [tokens.double(), logprobs.double(), codes.double()]
        if top is not None:
            parts += [top[0].double().t(), top[1].double().t()]
        packed = torch.cat([p.reshape(-1) for p in parts])
        out = self._out[: packed.numel()]
        out.copy_(packed, non_blocking=True)
        if self._event is not None:  # wait for this copy only (the model's device, whichever is current)
            self._event.record(torch.cuda.current_stream(self.device))
            self._event.synchronize()
        res = out.view(-1, B).tolist()
        tv = ti = None
        if top is not None:
            k = top[0].shape[1]
            tv = [list(c) for c in zip(*res[3: 3 + k])]
            ti = [[int(x) for x in c] for c in zip(*res[3 + k: 3 + 2 * k])]
        return [int(x) for x in res[0]], res[1], [int(x) for x in res[2]], tv, ti
