"""Vectorised sampling of one token per row, with the log-probability of what was sampled.

Logprob convention (the `mu` logprobs an RL trainer uses as behaviour policy):
- temperature > 0: log-probability under the distribution actually sampled from: logits / temperature,
  restricted to the top-k and top-p (nucleus) set, renormalised over that set.
- a constrained sequence (SamplingParams.structured, grammar.py): the same, with the tokens its grammar does not
  allow next masked out of the logits first, so the logprob is under the masked distribution it was drawn from.
- temperature == 0 (greedy): the token is the argmax and its logprob is the plain temperature-1 log-softmax
  (top-k / top-p ignored), since the "sampled" distribution would be a point mass (logprob 0). A temperature
  below GREEDY_BELOW is greedy too (as vLLM): logits / 1e-39 overflow float32 to inf, whose softmax is NaN.
`top_logprobs` are taken from the same distribution as the logprob; tokens outside the top-k/top-p set are left
out (they have probability 0).

Randomness: each row draws one uniform number u and takes the inverse CDF. Rows with a seed draw u from their
own torch.Generator (so a seeded request gives the same tokens whatever its batch neighbours); the others share
the engine's generator in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inflight.engine.model.grammar import GrammarSpec

MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    top_logprobs: int = 0
    ignore_eos: bool = False
    priority: int = 0  # admission order among waiting requests: lower first, then arrival
    prompt_logprobs: int | None = None  # score the prompt (prompt_scores.py) with this many alternatives
    structured: GrammarSpec | None = None  # the output must match it: grammar-constrained decoding (grammar.py)

    def __post_init__(self) -> None:
        if 0 < self.temperature < GREEDY_BELOW:  # every sampler reads the field: one place makes them all greedy
            self.temperature = 0.0

    def check(self, max_n: int) -> None:
        """Raises ValueError naming the first bad field."""
        if not 1 <= self.n <= max_n:
            raise ValueError(f"n must be in [1, {max_n}], got {self.n}")
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(f"max_tokens must be >= 1 (0 only to score the prompt), got {self.max_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")


def top_p_top_k(logp: torch.Tensor, greedy: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """logp [B, V] renormalised over each row's top-k tokens within its top-p mass (the first token always kept;
    greedy rows keep every token: their logprob is the plain one). Batched tensor ops only (no host sync), so the
    device sampler uses it as well."""
    V = logp.shape[-1]
    p = torch.where(greedy, torch.ones_like(top_p), top_p)
    k = torch.where(greedy | (top_k <= 0), torch.full_like(top_k, V), top_k.clamp(max=V))
    s_logp, s_idx = logp.sort(dim=-1, descending=True)
    s_prob = s_logp.exp()
    before = s_prob.cumsum(-1) - s_prob  # mass strictly before each token
    rank = torch.arange(V, device=logp.device)[None]
    keep = ((before < p[:, None]) | (p[:, None] >= 1.0)) & (rank < k[:, None])
    keep[:, 0] = True
    s_logp = s_logp.masked_fill(~keep, float("-inf"))
    s_logp = s_logp - torch.logsumexp(s_logp, dim=-1, keepdim=True)
    return torch.empty_like(logp).scatter_(1, s_idx, s_logp)


def sample(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B] float32, 0 = greedy
    top_p: torch.Tensor,  # [B] float32 in (0, 1]
    top_k: torch.Tensor,  # [B] int64, 0 = off
    u: torch.Tensor,  # [B] float32 uniform in [0, 1)
    num_top: int = 0,  # how many top logprobs to return per row (max over rows)
    filtered: bool = True,  # False when no row uses top-p / top-k (skips a full-vocab sort)
    kernels=None,  # cpu_kernels.Kernels: unfiltered float32 CPU rows without top logprobs in one C pass each
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Returns (tokens [B], logprobs [B], (top values [B, k], top ids [B, k]) or None)."""
    if kernels is not None and not filtered and num_top == 0 and logits.dtype == torch.float32 \
            and logits.device.type == "cpu":
        return (*kernels.sample(logits.contiguous(), temperature, u), None)
    B, V = logits.shape
    greedy = temperature <= 0
    n_greedy = int(greedy.sum())  # host-side branches below skip whole-vocab passes nobody needs
    if n_greedy == B:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        t = torch.where(greedy, torch.ones_like(temperature), temperature)
        logp = torch.log_softmax(logits if bool((t == 1).all()) else logits / t[:, None], dim=-1)
        if filtered:
            logp = top_p_top_k(logp, greedy, top_p, top_k)
        cdf = logp.exp().cumsum_(-1)
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=V - 1)
        if n_greedy:
            tokens = torch.where(greedy, logits.argmax(-1), tokens)
    logprobs = logp.gather(1, tokens[:, None])[:, 0]
    top = None
    if num_top > 0:
        vals, ids = logp.topk(min(num_top, V), dim=-1)
        top = (vals, ids)
    return tokens, logprobs, top
