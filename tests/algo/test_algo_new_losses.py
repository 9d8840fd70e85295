"""GSPO, GSPO-token, CISPO, Dr. GRPO's constant normaliser and sequence-level masked IS against float64 references
written from the papers' equations (loops over tokens in Python floats, gradients derived by hand), value and
gradient w.r.t. the logprobs at 1e-9; and the clear errors of bad settings."""

import math

import pytest
import torch

from inflight.algo import AlgoConfig, compute_advantages, make_loss
from inflight.config import RunConfig
from inflight.pipeline.launch_common import check_ranks
from tests.algo.test_algo_losses import PROMPT, SEQ, make_batch, run

torch.set_num_threads(1)


def lists(b, logp):
    L = lambda x: [float(v) for v in x]  # noqa: E731
    return L(logp), L(b.behaviour_logprobs), L(b.advantages), L(b.loss_mask), [int(i) for i in b.sample_index]


def token_scale(b, how: str, C: float = 0.0) -> list[float]:
    """The weight of each trained token's term in the step loss, per normalisation."""
    _, _, _, mask, sidx = lists(b, b.behaviour_logprobs)
    n_s = [sum(m for m, s in zip(mask, sidx, strict=True) if s == k) for k in range(len(b.seq_lens))]
    out = []
    for m, s in zip(mask, sidx, strict=True):
        if not m:
            out.append(0.0)
        elif how == "sequence_length":
            out.append(1 / (n_s[s] * b.num_samples_in_step))
        elif how == "sequences":
            out.append(1 / b.num_samples_in_step)
        elif how == "tokens":
            out.append(1 / b.num_tokens_in_step)
        else:  # constant
            out.append(1 / (b.num_samples_in_step * C))
    return out


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def gspo_reference(cfg: AlgoConfig, b, logp, how: str, token_level: bool):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"):
    eq. 5  J = E[1/G Σ_i min(s_i Â_i, clip(s_i, 1−ε, 1+ε) Â_i)]  (left/right ranges ε_low, ε_high)
    eq. 7  s_i = (π(y_i|x)/π_old(y_i|x))^(1/|y_i|) = exp(1/|y_i| Σ_t log π_t/π_old,t)
    gradient (eq. 11): ∇ = s_i Â_i · 1/|y_i| Σ_t ∇log π_t where the unclipped branch is the min, else 0.
    GSPO-token, eq. 13-14: per token min(s_it Â_it, clip(s_it) Â_it), s_it = sg[s_i] π_t / sg[π_t]: the value of s_i,
    the gradient of its own token only (eq. 18: s_i Â_it ∇log π_t)."""
    lp, mu, adv, mask, sidx = lists(b, logp)
    n_seq = len(b.seq_lens)
    n = [sum(mask[t] for t in range(len(lp)) if sidx[t] == i) for i in range(n_seq)]
    s = [math.exp(sum(lp[t] - mu[t] for t in range(len(lp)) if sidx[t] == i and mask[t]) / n[i]) if n[i] else 1.0
         for i in range(n_seq)]
    A_seq = [sum(adv[t] for t in range(len(lp)) if sidx[t] == i and mask[t]) / n[i] if n[i] else 0.0
             for i in range(n_seq)]
    lo, hi = 1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high
    scale = token_scale(b, how)
    loss, grad, clipped = 0.0, [0.0] * len(lp), 0
    for t in range(len(lp)):
        if not mask[t]:
            continue
        i = sidx[t]
        A = adv[t] if token_level else A_seq[i]
        unclipped, clipped_branch = s[i] * A, clip(s[i], lo, hi) * A
        is_clipped = clipped_branch < unclipped  # the min takes the constant, clipped branch
        clipped += is_clipped
        loss += scale[t] * -min(unclipped, clipped_branch)
        if is_clipped:
            continue
        if token_level:
            grad[t] += scale[t] * -A * s[i]
        else:  # this token's copy of ℓ_i reaches every token u of sample i through s_i: ∂s_i/∂lp_u = s_i / n_i
            for u in range(len(lp)):
                if sidx[u] == i and mask[u]:
                    grad[u] += scale[t] * -A * s[i] / n[i]
    return loss, grad, clipped


def cispo_reference(cfg: AlgoConfig, b, logp, how: str):
    """CISPO (MiniMax-M1, arXiv 2506.13585, §3.1): J = 1/Σ_i|o_i| Σ_i Σ_t sg(r̂_it) Â_it log π_t, with the clipped
    IS weight r̂ = clip(r, 1−ε_low^IS, 1+ε_high^IS), r = π/π_old. ∂/∂log π_t = r̂ Â (every token keeps a gradient)."""
    lp, mu, adv, mask, _ = lists(b, logp)
    scale = token_scale(b, how)
    loss, grad = 0.0, [0.0] * len(lp)
    for t in range(len(lp)):
        if mask[t]:
            w = clip(math.exp(lp[t] - mu[t]), 1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high)
            loss += scale[t] * -w * adv[t] * lp[t]
            grad[t] = scale[t] * -w * adv[t]
    return loss, grad


def check(cfg, batch, logp, ref_loss, ref_grad):
    loss, grad, stats = run(cfg, batch, logp, None)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    assert grad.tolist() == pytest.approx(ref_grad, rel=1e-9, abs=1e-12)
    return stats


BATCH = dict(n_seq=7, n_tok=80)


@pytest.mark.parametrize("how", ["auto", "sequences", "tokens", "sequence_length"])
@pytest.mark.parametrize("token_level", [False, True], ids=["gspo", "gspo_token"])
@pytest.mark.parametrize("clips,noise", [((3e-4, 4e-4), 2e-3), ((0.1, 0.15), 0.3)], ids=["paper", "wide"])
def test_gspo_matches_the_paper(how, token_level, clips, noise):
    cfg = AlgoConfig(loss="gspo_token" if token_level else "gspo", normalization=how, gspo_clip_low=clips[0],
                     gspo_clip_high=clips[1])
    batch, logp, _ = make_batch(SEQ, PROMPT, seed=17, noise=noise, **BATCH)  # a seed that clips some samples
    if token_level:  # per-token advantages that differ inside a sample (e.g. REINFORCE++ with KL in the return)
        batch.advantages = batch.advantages + 0.3 * torch.randn(len(logp), generator=torch.Generator().manual_seed(2),
                                                                dtype=torch.float64)
    paper = "sequence_length" if how == "auto" else how  # the paper's 1/G Σ_i of a per-sequence term
    ref_loss, ref_grad, clipped = gspo_reference(cfg, batch, logp, paper, token_level)
    stats = check(cfg, batch, logp, ref_loss, ref_grad)
    assert stats["clipped"] == clipped
    assert 0 < stats["clip_frac"] < 1  # the random ratios reach both branches of the min


def test_gspo_token_equals_gspo_when_a_samples_advantages_are_equal():
    """GSPO paper, eq. 11 vs eq. 18: with Â_it = Â_i the two objectives have the same value and gradient."""
    batch, logp, _ = make_batch(SEQ, PROMPT, seed=12, noise=2e-4, **BATCH)
    a, ga, _ = run(AlgoConfig(loss="gspo"), batch, logp, None)
    b, gb, _ = run(AlgoConfig(loss="gspo_token"), batch, logp, None)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    assert ga.tolist() == pytest.approx(gb.tolist(), rel=1e-9, abs=1e-15)
    assert ga.abs().max() > 0


@pytest.mark.parametrize("how", ["auto", "sequences"])
@pytest.mark.parametrize("clips", [(1.0, 4.0), (0.2, 0.28), (0.5, math.inf)])
def test_cispo_matches_the_paper(how, clips):
    cfg = AlgoConfig(loss="cispo", normalization=how, cispo_clip_low=clips[0], cispo_clip_high=clips[1])
    batch, logp, _ = make_batch(SEQ, PROMPT, seed=13, **BATCH)
    ref_loss, ref_grad = cispo_reference(cfg, batch, logp, "tokens" if how == "auto" else how)
    stats = check(cfg, batch, logp, ref_loss, ref_grad)
    trained = batch.loss_mask > 0
    # no token is dropped: every trained token has a gradient, also where the weight is clipped
    assert bool((torch.tensor(ref_grad)[trained & (batch.advantages != 0)] != 0).all())
    if clips == (0.2, 0.28):
        assert 0 < stats["clip_frac"] < 1


def dr_grpo_reference(cfg: AlgoConfig, b, logp):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.2, eq. 2 without its 1/|o_i| and
    std(R) terms): J = 1/G Σ_i Σ_t min(r_t Â_i, clip(r_t, 1−ε, 1+ε) Â_i) / C, C a constant (the generation budget).
    ∂/∂log π_t = r_t Â_i / (G C) where the unclipped branch is the min, else 0."""
    lp, mu, adv, mask, _ = lists(b, logp)
    denom = b.num_samples_in_step * cfg.norm_constant
    loss, grad = 0.0, [0.0] * len(lp)
    for t in range(len(lp)):
        if mask[t]:
            r, A = math.exp(lp[t] - mu[t]), adv[t]
            un, cl = r * A, clip(r, 1 - cfg.clip_low, 1 + cfg.clip_high) * A
            loss -= min(un, cl) / denom
            grad[t] = 0.0 if cl < un else -A * r / denom
    return loss, grad


def mis_reference(cfg: AlgoConfig, b, logp):
    """Masked IS at sequence level (verl's rollout correction, rejection sampling `sequence` / `geometric`, after
    Liu, Li et al. 2025, "When Speed Kills Stability"): ρ_i = Π_t π_t/μ_t (or its |y_i|-th root); a sample with
    ρ_i ∉ [low, high] is left out of the loss, the others keep GRPO's terms −Â w log π (w = min(π/μ, is_cap)),
    the denominators unchanged. Returns (loss, grad, kept per sample, dropped tokens)."""
    lp, mu, adv, mask, sidx = lists(b, logp)
    kept, dropped_tokens = [], 0
    for i in range(len(b.seq_lens)):
        toks = [t for t in range(len(lp)) if sidx[t] == i and mask[t]]
        log_rho = sum(lp[t] - mu[t] for t in toks) / (len(toks) if cfg.is_mask == "geometric" and toks else 1)
        kept.append(cfg.is_mask_low <= math.exp(log_rho) <= cfg.is_mask_high)
        dropped_tokens += 0 if kept[-1] else len(toks)
    loss, grad = 0.0, [0.0] * len(lp)
    for t in range(len(lp)):
        if mask[t] and kept[sidx[t]]:
            w = min(math.exp(lp[t] - mu[t]), cfg.is_cap)
            loss += -adv[t] * w * lp[t] / b.num_samples_in_step
            grad[t] = -adv[t] * w / b.num_samples_in_step
    return loss, grad, kept, dropped_tokens


def test_dr_grpo_advantage_and_constant_normaliser():
    """Dr. GRPO's advantage is Â_i = R_i − mean(R) (no std): inflight's defaults; its loss as dr_grpo_reference."""
    rewards = [[1.0, 0.0, 0.0, 1.0, 1.0]]
    got = compute_advantages(rewards, AlgoConfig())  # the defaults: group_mean, normalize_std off
    assert got == [pytest.approx([r - sum(rewards[0]) / 5 for r in rewards[0]], abs=1e-15)]
    cfg = AlgoConfig(loss="ppo", normalization="constant", norm_constant=37.0)
    batch, logp, _ = make_batch(SEQ, PROMPT, seed=14, **BATCH)
    stats = check(cfg, batch, logp, *dr_grpo_reference(cfg, batch, logp))
    assert 0 < stats["clip_frac"] < 1


@pytest.mark.parametrize("mode", ["sequence", "geometric"])
def test_sequence_masked_is_drops_whole_samples(mode):
    low, high = (0.3, 3.0) if mode == "sequence" else (0.9, 1.1)
    cfg = AlgoConfig(is_mask=mode, is_mask_low=low, is_mask_high=high)
    batch, logp, _ = make_batch(SEQ, PROMPT, seed=15, noise=0.3, **BATCH)
    loss, grad, kept, dropped_tokens = mis_reference(cfg, batch, logp)
    stats = check(cfg, batch, logp, loss, grad)
    assert stats["masked"] == dropped_tokens > 0 and any(kept)


def test_new_settings_give_clear_errors():
    for bad, match in [
        (dict(loss="gspo", gspo_clip_low=1.0), "gspo_clip_low"),
        (dict(loss="gspo", gspo_clip_high=-1.0), "gspo_clip_high"),
        (dict(loss="cispo", cispo_clip_high=-0.1), "cispo_clip_high"),
        (dict(normalization="constant", norm_constant=0.0), "norm_constant"),
        (dict(normalization="constant_length"), "normalization"),
        (dict(is_mask="token"), "is_mask"),
        (dict(is_mask="sequence", is_mask_low=1.5), "is_mask_low"),
        (dict(is_mask="geometric", is_mask_high=1.0), "is_mask_high"),
        (dict(advantage="reinforce"), "advantage"),
        (dict(advantage="reinforce_pp", kl_reward_estimator="k3"), "kl_reward_estimator"),
        (dict(kl_reward_coef=0.1), "kl_reward_coef"),  # KL in the return is REINFORCE++'s; grpo takes kl_coef
        (dict(advantage="reinforce_pp", kl_reward_coef=-0.1), "kl_reward_coef"),
        (dict(advantage="reinforce_pp_baseline", normalize_std=True), "normalize_std"),
        (dict(loss="cispo", is_level="sequence"), "is_level"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_loss(AlgoConfig(**bad))
    with pytest.raises(ValueError, match="trainer loop"):  # per step, not per group
        compute_advantages([[1.0, 0.0]], AlgoConfig(advantage="reinforce_pp"))
    cfg = RunConfig()  # REINFORCE++ runs on FSDP2 too (its step statistics summed over the ranks)
    cfg.trainer.backend, cfg.algo.advantage = "fsdp2", "reinforce_pp_baseline"
    check_ranks(cfg)
