"""RL policy losses, selectable by name (`AlgoConfig.loss`), and the normalisation that turns per-token terms
into the loss of one packed micro-batch.

Notation, per token t: log π = `logprobs` (the trainer's current weights, with grad), log μ =
`batch.behaviour_logprobs` (the policy that sampled the token, as the server reported it), log π_prox =
`batch.prox_logprobs` (the trainer's weights before this optimizer step), A = `batch.advantages` (the sample's
advantage on each of its tokens), m = `batch.loss_mask`. Logprobs arrive temperature-aware; nothing is rescaled here.

Policy terms ℓ_t (sg = stop-gradient):
    grpo           −A · w · log π,   w = sg(clamp(π/μ, 0, c)),  c = is_cap (inf: w = π/μ; 0: w = 1, REINFORCE)
    ppo            −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A),  r = π/μ
    decoupled_ppo  −b · min(u·A, clip(u, 1−ε_low, 1+ε_high)·A),  u = π/π_prox,  b = π_prox/μ;  where b >
                   behaviour_cap the token is dropped (mode `mask`) or b = behaviour_cap (mode `clamp`)
    aipo           −sg(min(π/μ, ρ)) · A · log π,  ρ = aipo_rho
    gspo           −min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i) on each token of sample i, s_i = the geometric
                   mean of its tokens' π/μ, clipped per sequence (gspo_clip_*; sequence.py)
    gspo_token     −min(s_t·A, clip(s_t, 1−ε_low, 1+ε_high)·A),  s_t = sg(s_i)·π_t/sg(π_t)  (sequence.py)
    cispo          −sg(clip(π/μ, 1−ε_low, 1+ε_high)) · A · log π  (cispo_clip_*): every token keeps its gradient
  grpo and aipo take π/μ per token (is_level `token`: the token's own ratio) or per sequence (`sequence`: the
  product of the ratios of the sample's trained tokens, on each of them). The token ratio corrects which token was
  drawn but not the prefix it was drawn after; the sequence ratio corrects both (unbiased, at more variance).
  Any loss + is_mask (sequence | geometric): samples whose sequence ratio π/μ is outside [is_mask_low,
  is_mask_high] are dropped whole (masked importance sampling, sequence.py).
  + kl_coef · min(exp(ref − log π) − (ref − log π) − 1, kl_clamp)    (k3 estimate of KL(π‖ref), needs ref_logprobs)
  − entropy_coef · H_t                                                (entropy bonus; the loss then needs_entropy)

Normalisation, side by side. N_seq = batch.num_samples_in_step and N_tok = batch.num_tokens_in_step count the
whole optimizer step (all micro-batches, all ranks), so the micro-batch losses of one step add up to the step loss:
    sequences        L = Σ_t m_t ℓ_t / N_seq                  every token weighs the same, a long answer counts
                                                              more than a short one (PipelineRL; default)
    tokens           L = Σ_t m_t ℓ_t / N_tok                  same weighting, scale independent of answer lengths
    sequence_length  L = Σ_s (Σ_{t∈s} m_t ℓ_t / n_s) / N_seq  every sequence weighs the same, n_s = its trained
                                                              tokens (original GRPO); a sample with n_s = 0 adds 0
    constant         L = Σ_t m_t ℓ_t / (N_seq · C)             C = norm_constant (Dr. GRPO: no length normalisation,
                                                              a constant; the trainer sets 0 to actor.max_new_tokens)
    auto             the loss's paper: tokens for cispo, sequence_length for gspo / gspo_token, else sequences
A token dropped by decoupled_ppo's or is_mask's mask loses its policy term only; the denominators do not change.

Stats of one call are floats. Sums, to be added across micro-batches (see `merge_stats`): loss, tokens, ratio_sum,
w_sum, w_sq_sum, clipped, masked, kl_sum, entropy_sum; max: ratio_max; derived from those (recomputed by
`merge_stats`): ratio_mean (π/μ), clip_frac, mask_frac, ess = (Σw)²/(N·Σw²) of the importance weights w the loss
applies (grpo/aipo: truncated π/μ, 1 when is_cap = 0; ppo: π/μ; decoupled_ppo: b after the cap, 0 if dropped;
gspo*: s_i; cispo: the clipped π/μ), kl,
entropy (means over trained tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from inflight.algo import reinforce_pp, sequence, truncation
from inflight.algo.advantages import BASELINES, STEP_LEVEL
from inflight.algo.sequence import Samples
from inflight.config.algo import AlgoConfig
from inflight.contracts import LossFn, TrainBatch

NORMALIZATIONS = ("auto", "sequences", "tokens", "sequence_length", "constant")
PAPER_NORMALIZATION = {"cispo": "tokens", "gspo": "sequence_length", "gspo_token": "sequence_length"}
IS_LEVELS = ("token", "sequence")
BEHAVIOUR_CAP_MODES = ("mask", "clamp")


@dataclass
class PolicyTerm:
    """A loss's per-token policy term and what the stats need; all [T]."""

    loss: torch.Tensor  # ℓ_t before masking and normalisation (with grad)
    weight: torch.Tensor  # importance weight applied to the token (no grad), for the ESS
    clipped: torch.Tensor  # bool: the clip is active (ppo family: the term is constant, gradient 0; cispo: w clipped)
    dropped: torch.Tensor  # bool: token removed from the policy term


def _none(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x, dtype=torch.bool)


def ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float):
    """−min(ratio·A, clip(ratio, 1−ε_low, 1+ε_high)·A) and where the clip is active. The clipped branch is the
    minimum only strictly outside the interval, on the side A pushes towards; there the term is constant.
    A ratio exactly on the boundary is not clipped (gradient −A·ratio)."""
    clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    bound = ratio.detach().clamp(1 - eps_low, 1 + eps_high)
    return -torch.where(clipped, bound * adv, ratio * adv), clipped


def capped_weight(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(log_w), cap) without overflow (a sequence's log ratio can be large), no grad."""
    return torch.exp(log_w.detach().clamp(max=math.log(cap) if math.isfinite(cap) else 80.0)).clamp(max=cap)


def grpo(logp, mu, prox, adv, cfg: AlgoConfig, log_w, seq) -> PolicyTerm:
    """ℓ = −A · w · log π,  w = sg(clamp(π/μ, 0, c)), c = is_cap; c = inf: w = π/μ; c = 0: w = 1 (no IS).
    ∂ℓ/∂log π = −A·w."""
    w = torch.ones_like(logp) if cfg.is_cap == 0 else capped_weight(log_w, cfg.is_cap)
    return PolicyTerm(-adv * w * logp, w, _none(logp), _none(logp))


def ppo(logp, mu, prox, adv, cfg: AlgoConfig, log_w, seq) -> PolicyTerm:
    """ℓ = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A),  r = π/μ.  ∂ℓ/∂log π = −A·r unclipped, 0 clipped."""
    ratio = torch.exp(logp - mu)
    loss, clipped = ppo_clip(ratio, adv, cfg.clip_low, cfg.clip_high)
    return PolicyTerm(loss, ratio.detach(), clipped, _none(logp))


def decoupled_ppo(logp, mu, prox, adv, cfg: AlgoConfig, log_w, seq) -> PolicyTerm:
    """ℓ = −b · min(u·A, clip(u, 1−ε_low, 1+ε_high)·A),  u = π/π_prox,  b = π_prox/μ (no grad), with b >
    behaviour_cap dropped (`mask`) or set to the cap (`clamp`).  ∂ℓ/∂log π = −b·A·u unclipped, 0 clipped."""
    b = torch.exp(prox - mu).detach()
    if cfg.behaviour_cap_mode == "mask":
        dropped = b > cfg.behaviour_cap
        b = torch.where(dropped, torch.zeros_like(b), b)
    else:
        dropped, b = _none(b), b.clamp(max=cfg.behaviour_cap)
    loss, clipped = ppo_clip(torch.exp(logp - prox), adv, cfg.clip_low, cfg.clip_high)
    return PolicyTerm(b * loss, b, clipped, dropped)


def aipo(logp, mu, prox, adv, cfg: AlgoConfig, log_w, seq) -> PolicyTerm:
    """ℓ = −sg(min(π/μ, ρ)) · A · log π,  ρ = aipo_rho.  ∂ℓ/∂log π = −A·min(π/μ, ρ)."""
    w = capped_weight(log_w, cfg.aipo_rho)
    return PolicyTerm(-w * adv * logp, w, _none(logp), _none(logp))


def gspo(logp, mu, prox, adv, cfg: AlgoConfig, log_w, seq: Samples) -> PolicyTerm:
    """ℓ_i = −min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i) on each trained token of sample i (sequence.py).
    ∂ℓ_i/∂log π_t = −A_i·s_i/|y_i| unclipped, 0 clipped."""
    s = sequence.gspo_ratio(logp, mu, seq)
    loss, clipped = ppo_clip(s, seq.mean(adv), cfg.gspo_clip_low, cfg.gspo_clip_high)
    return PolicyTerm(loss, s.detach(), clipped, _none(logp))


def gspo_token(logp, mu, prox, adv, cfg: AlgoConfig, log_w, seq: Samples) -> PolicyTerm:
    """ℓ_t = −min(s_t·A_t, clip(s_t, 1−ε_low, 1+ε_high)·A_t),  s_t = sg(s_i)·π_t/sg(π_t).
    ∂ℓ_t/∂log π_t = −A_t·s_i unclipped, 0 clipped."""
    s = sequence.gspo_ratio(logp, mu, seq).detach() * torch.exp(logp - logp.detach())
    loss, clipped = ppo_clip(s, adv, cfg.gspo_clip_low, cfg.gspo_clip_high)
    return PolicyTerm(loss, s.detach(), clipped, _none(logp))


def cispo(logp, mu, prox, adv, cfg: AlgoConfig, log_w, seq) -> PolicyTerm:
    """ℓ = −sg(clip(π/μ, 1−ε_low, 1+ε_high)) · A · log π (MiniMax-M1, §3.1).  ∂ℓ/∂log π = −A·w: no token
    loses its gradient, the weight is only bounded."""
    hi = math.log1p(cfg.cispo_clip_high) if math.isfinite(cfg.cispo_clip_high) else 80.0
    lo = math.log(1 - cfg.cispo_clip_low) if cfg.cispo_clip_low < 1 else -math.inf
    w = torch.exp(log_w.detach().clamp(lo, hi))
    return PolicyTerm(-w * adv * logp, w, (log_w < lo) | (log_w > hi), _none(logp))


LOSSES: dict[str, Callable[..., PolicyTerm]] = {"grpo": grpo, "ppo": ppo, "decoupled_ppo": decoupled_ppo, "aipo": aipo,
                                                "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo}


def normalization_of(cfg: AlgoConfig) -> str:
    """cfg.normalization, with `auto` resolved to the loss's paper (module docstring)."""
    return PAPER_NORMALIZATION.get(cfg.loss, "sequences") if cfg.normalization == "auto" else cfg.normalization


def kl_k3(logp: torch.Tensor, ref: torch.Tensor, clamp_max: float) -> torch.Tensor:
    """min(exp(ref − log π) − (ref − log π) − 1, kl_clamp) per token; ≥ 0, = 0 where π = ref.
    ∂/∂log π = 1 − exp(ref − log π) below the clamp, 0 above it."""
    d = ref - logp
    return (torch.exp(d) - d - 1).clamp(max=clamp_max)


def normalize(per_token: torch.Tensor, mask: torch.Tensor, batch: TrainBatch, how: str,
              constant: float = 0.0) -> torch.Tensor:
    """The micro-batch loss from masked per-token terms (see the module docstring for the modes)."""
    if how == "constant":  # Dr. GRPO: the mean over sequences of Σ_t ℓ_t / C, C fixed for the whole run
        return per_token.sum() / (max(batch.num_samples_in_step, 1) * constant)
    if how == "sequences":
        return per_token.sum() / max(batch.num_samples_in_step, 1)
    if how == "tokens":  # a step without trained tokens has only zero terms: any denominator >= 1 gives 0
        return per_token.sum() / max(batch.num_tokens_in_step, 1)
    n = len(batch.seq_lens)
    per_seq = per_token.new_zeros(n).index_add(0, batch.sample_index, per_token)
    n_tok = per_token.new_zeros(n).index_add(0, batch.sample_index, mask.to(per_token.dtype))
    return (per_seq / n_tok.clamp(min=1)).sum() / max(batch.num_samples_in_step, 1)


def _check_cfg(cfg: AlgoConfig) -> None:
    if cfg.loss not in LOSSES:
        raise ValueError(f"unknown algo.loss {cfg.loss!r}; choose one of {sorted(LOSSES)}")
    if cfg.normalization not in NORMALIZATIONS:
        raise ValueError(f"unknown algo.normalization {cfg.normalization!r}; choose one of {list(NORMALIZATIONS)}")
    if cfg.normalization == "constant" and not cfg.norm_constant > 0:
        raise ValueError(f"algo.normalization=constant needs algo.norm_constant > 0 (the trainer sets 0 to "
                         f"actor.max_new_tokens), got {cfg.norm_constant}")
    if cfg.is_level not in IS_LEVELS or (cfg.is_level != "token" and cfg.loss not in ("grpo", "aipo")):
        raise ValueError(f"algo.is_level must be one of {list(IS_LEVELS)} (sequence: grpo and aipo only), got "
                         f"{cfg.is_level!r} with algo.loss={cfg.loss!r}")
    if cfg.behaviour_cap_mode not in BEHAVIOUR_CAP_MODES:
        raise ValueError(f"unknown algo.behaviour_cap_mode {cfg.behaviour_cap_mode!r}; choose mask or clamp")
    for name in ("is_cap", "clip_low", "clip_high", "kl_coef", "kl_clamp", "entropy_coef", "gspo_clip_low",
                 "gspo_clip_high", "cispo_clip_low", "cispo_clip_high", "kl_reward_coef"):
        if not getattr(cfg, name) >= 0:
            raise ValueError(f"algo.{name} must be >= 0, got {getattr(cfg, name)}")
    for name in ("behaviour_cap", "aipo_rho"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"algo.{name} must be > 0, got {getattr(cfg, name)}")
    if cfg.gspo_clip_low >= 1 and cfg.loss in ("gspo", "gspo_token"):
        raise ValueError(f"algo.gspo_clip_low must be < 1 (the ratio's lower bound is 1 - it), got {cfg.gspo_clip_low}")
    if cfg.advantage not in BASELINES and cfg.advantage not in STEP_LEVEL:
        raise ValueError(f"unknown algo.advantage {cfg.advantage!r}; choose one of "
                         f"{sorted(BASELINES) + list(STEP_LEVEL)}")
    sequence.check(cfg)
    reinforce_pp.check(cfg)
    truncation.check(cfg.truncated, cfg.overlong_penalty, cfg.overlong_buffer)


def _check_batch(logprobs: torch.Tensor, batch: TrainBatch, cfg: AlgoConfig, entropy: torch.Tensor | None) -> None:
    T = batch.num_tokens
    tensors = {"logprobs": logprobs, "loss_mask": batch.loss_mask, "advantages": batch.advantages,
               "behaviour_logprobs": batch.behaviour_logprobs, "sample_index": batch.sample_index,
               "prox_logprobs": batch.prox_logprobs, "ref_logprobs": batch.ref_logprobs, "entropy": entropy}
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != (T,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({T},) like batch.input_ids")
    if cfg.loss == "decoupled_ppo" and batch.prox_logprobs is None:
        raise ValueError("algo.loss=decoupled_ppo needs batch.prox_logprobs (the trainer's logprobs with the "
                         "weights before this optimizer step, from forward_logprobs)")
    if cfg.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError(f"algo.kl_coef={cfg.kl_coef} needs batch.ref_logprobs (reference-model logprobs)")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(f"algo.entropy_coef={cfg.entropy_coef} needs the per-token entropy (loss.needs_entropy)")
    if batch.num_samples_in_step < 0 or batch.num_tokens_in_step < 0:
        raise ValueError("batch.num_samples_in_step and num_tokens_in_step must be >= 0 (they count the step)")
    # the denominator in use counts the whole step, so it cannot be below this micro-batch's own count
    m = batch.loss_mask > 0
    how = normalization_of(cfg)
    if how == "tokens" and batch.num_tokens_in_step < int(m.sum()):
        raise ValueError(f"batch.num_tokens_in_step={batch.num_tokens_in_step} counts the whole step, yet this "
                         f"micro-batch alone trains {int(m.sum())} tokens")
    n_seq = int(batch.sample_index[m].unique().numel())
    if how != "tokens" and batch.num_samples_in_step < n_seq:
        raise ValueError(f"batch.num_samples_in_step={batch.num_samples_in_step} counts the whole step, yet this "
                         f"micro-batch alone trains {n_seq} samples")
    if T > 0 and int(batch.sample_index.max()) >= len(batch.seq_lens):
        raise ValueError("batch.sample_index points past batch.seq_lens")


class PolicyLoss:
    """A `contracts.LossFn`: (logprobs [T] with grad, batch, entropy [T] | None) -> (scalar loss, stats)."""

    def __init__(self, cfg: AlgoConfig):
        _check_cfg(cfg)
        self.cfg = cfg
        self.term = LOSSES[cfg.loss]
        self.needs_entropy = cfg.entropy_coef > 0
        self.normalization = normalization_of(cfg)

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None = None):
        cfg = self.cfg
        _check_batch(logprobs, batch, cfg, entropy)
        dt = torch.promote_types(logprobs.dtype, torch.float32)  # exp of bf16 differences is too coarse
        m = batch.loss_mask > 0
        mf = m.to(dt)

        def trained(x: torch.Tensor) -> torch.Tensor:
            # untrained tokens (prompt, first token) may hold anything: zero them so exp() stays finite there
            return torch.where(m, x.to(dt), torch.zeros((), dtype=dt, device=x.device))

        logp, mu, adv = trained(logprobs), trained(batch.behaviour_logprobs), trained(batch.advantages)
        prox, ref, ent = (None if x is None else trained(x) for x in (batch.prox_logprobs, batch.ref_logprobs, entropy))
        log_w = (logp - mu).detach()  # log π/μ per token; 0 where untrained
        seq = Samples(batch.sample_index, len(batch.seq_lens), mf)
        if cfg.is_level == "sequence":
            log_w = seq.sum(log_w)[batch.sample_index]
        pg = self.term(logp, mu, prox, adv, cfg, log_w, seq)
        pg.dropped = pg.dropped | sequence.masked_out((logp - mu).detach(), seq, cfg)
        keep = m & ~pg.dropped
        per_token = torch.where(keep, pg.loss, torch.zeros_like(pg.loss))
        kl = kl_k3(logp, ref, cfg.kl_clamp) * mf if ref is not None else None
        if cfg.kl_coef > 0:
            assert kl is not None  # _check_batch: kl_coef > 0 needs ref_logprobs
            per_token = per_token + cfg.kl_coef * kl
        if cfg.entropy_coef > 0:
            assert ent is not None  # _check_batch: entropy_coef > 0 needs the entropy
            per_token = per_token - cfg.entropy_coef * ent
        loss = normalize(per_token, m, batch, self.normalization, cfg.norm_constant)

        with torch.no_grad():
            ratio = torch.exp(logp - mu)[m]
            w = torch.where(pg.dropped, torch.zeros_like(pg.weight), pg.weight)[m].double()
            stats = {
                "loss": float(loss.detach()),
                "tokens": float(m.sum()),
                "ratio_sum": float(ratio.double().sum()),
                "ratio_max": float(ratio.max()) if ratio.numel() else 0.0,
                "w_sum": float(w.sum()),
                "w_sq_sum": float((w * w).sum()),
                "clipped": float((pg.clipped & m).sum()),
                "masked": float((pg.dropped & m).sum()),
                "kl_sum": float(kl.double().sum()) if kl is not None else 0.0,
                "entropy_sum": float(ent.double().sum()) if ent is not None else 0.0,
            }
        return loss, derive_stats(stats)


def make_loss(cfg: AlgoConfig) -> LossFn:
    """The loss named by cfg.loss, with cfg's normalisation, KL and entropy terms (a `contracts.LossFn`)."""
    return PolicyLoss(cfg)


# --------------------------------------------------------------------------------------------------------------
# Stats across micro-batches, and policy lag
# --------------------------------------------------------------------------------------------------------------

SUM_KEYS = ("loss", "tokens", "ratio_sum", "w_sum", "w_sq_sum", "clipped", "masked", "kl_sum", "entropy_sum")
MAX_KEYS = ("ratio_max",)


def derive_stats(s: dict[str, float]) -> dict[str, float]:
    """Add the means (ratio_mean, clip_frac, mask_frac, kl, entropy over trained tokens) and the ESS to raw sums."""
    n = s["tokens"]
    out = dict(s)
    out["ratio_mean"] = s["ratio_sum"] / n if n else 0.0
    out["clip_frac"] = s["clipped"] / n if n else 0.0
    out["mask_frac"] = s["masked"] / n if n else 0.0
    out["ess"] = s["w_sum"] ** 2 / (n * s["w_sq_sum"]) if n and s["w_sq_sum"] > 0 else 0.0
    out["kl"] = s["kl_sum"] / n if n else 0.0
    out["entropy"] = s["entropy_sum"] / n if n else 0.0
    return out


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Step stats from the stats of its micro-batches (sums added, maxima maxed, means and ESS recomputed)."""
    if not parts:
        raise ValueError("merge_stats needs at least one micro-batch's stats")
    s = {k: math.fsum(p[k] for p in parts) for k in SUM_KEYS}
    s.update({k: max(p[k] for p in parts) for k in MAX_KEYS})
    return derive_stats(s)


def lag_stats(samples: list, weights_version: int) -> dict:
    """min / mean / max / histogram of weights_version − the version of every trained completion token (a sample
    without a prompt does not train its first token, an environment's tokens are not trained), over `samples` (contracts.Sample); zeros when none."""
    lags = []
    for s in samples:
        mask = s.loss_mask or [1] * len(s.versions)  # an environment's tokens (mask 0) have no version
        pairs = list(zip(s.versions, mask, strict=False))[(0 if s.prompt_ids else 1):]
        lags += [weights_version - v for v, m in pairs if m]
    return {"lag_min": min(lags, default=0), "lag_max": max(lags, default=0),
            "lag_mean": sum(lags) / max(1, len(lags)), "lag_tokens": len(lags),
            "lag_hist": {str(k): lags.count(k) for k in sorted(set(lags))}}
