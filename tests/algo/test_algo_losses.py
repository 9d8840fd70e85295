"""RL losses against a plain float64 reference (a loop over tokens, hand-derived gradients)."""

import math
import random

import pytest
import torch

from inflight.algo import AlgoConfig, lag_stats, make_loss, merge_stats
from inflight.contracts import Sample, TrainBatch

torch.set_num_threads(1)
INF = float("inf")


def make_batch(seq_lens, prompt_lens, seed=0, n_seq=None, n_tok=None, noise=0.8):
    """A packed batch of random samples (float64) and matching random current logprobs."""
    g = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    mask, sample_index, adv = torch.zeros(T), torch.zeros(T, dtype=torch.long), torch.zeros(T)
    pos = 0
    for s, (n, p) in enumerate(zip(seq_lens, prompt_lens)):
        mask[pos + max(p, 1) : pos + n] = 1.0  # prompt and the first token are never trained
        sample_index[pos : pos + n] = s
        adv[pos : pos + n] = float(torch.randn((), generator=g))
        pos += n
    logp = -3 * torch.rand(T, generator=g, dtype=torch.float64)
    rnd = lambda: noise * torch.randn(T, generator=g, dtype=torch.float64)  # noqa: E731
    batch = TrainBatch(
        input_ids=torch.randint(0, 50, (T,), generator=g),
        position_ids=torch.cat([torch.arange(n) for n in seq_lens]),
        seq_lens=list(seq_lens),
        loss_mask=mask,
        advantages=adv.double(),
        behaviour_logprobs=logp + rnd(),
        versions=torch.zeros(T, dtype=torch.long),
        sample_index=sample_index,
        num_samples_in_step=len(seq_lens) if n_seq is None else n_seq,
        num_tokens_in_step=int(mask.sum()) if n_tok is None else n_tok,
        prox_logprobs=logp + 0.5 * rnd(),
        ref_logprobs=logp + rnd(),
    )
    entropy = 2 * torch.rand(T, generator=g, dtype=torch.float64)
    return batch, logp, entropy


def reference(cfg: AlgoConfig, b: TrainBatch, logp, entropy):
    """(loss, grad list, stats) by loops over tokens, in Python floats."""
    T = b.num_tokens
    L = lambda x: [float(v) for v in x] if x is not None else None  # noqa: E731
    lp, mu, prox, ref, adv, mask = L(logp), L(b.behaviour_logprobs), L(b.prox_logprobs), L(b.ref_logprobs), \
        L(b.advantages), L(b.loss_mask)
    H, sidx = L(entropy), [int(i) for i in b.sample_index]
    term, grad = [0.0] * T, [0.0] * T
    ratios, weights, clipped, masked, kls, ents = [], [], 0, 0, [], []
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    seq_log_ratio = [0.0] * len(b.seq_lens)  # is_level sequence: log of the product of a sample's trained ratios
    for t in range(T):
        if mask[t]:
            seq_log_ratio[sidx[t]] += lp[t] - mu[t]
    for t in range(T):
        if mask[t] == 0:
            continue
        A, x = adv[t], lp[t]
        ratios.append(math.exp(x - mu[t]))
        if cfg.loss in ("grpo", "aipo"):
            cap = cfg.is_cap if cfg.loss == "grpo" else cfg.aipo_rho
            log_ratio = seq_log_ratio[sidx[t]] if cfg.is_level == "sequence" else x - mu[t]
            w = 1.0 if (cfg.loss == "grpo" and cap == 0) else min(math.exp(log_ratio), cap)
            term[t], grad[t] = -A * w * x, -A * w
        else:
            if cfg.loss == "ppo":
                w, r = 1.0, math.exp(x - mu[t])
            else:
                w, r = math.exp(prox[t] - mu[t]), math.exp(x - prox[t])
                if w > cfg.behaviour_cap:
                    if cfg.behaviour_cap_mode == "mask":
                        w = 0.0
                        masked += 1
                    else:
                        w = cfg.behaviour_cap
            unclipped, clip = r * A, min(max(r, lo), hi) * A
            if clip < unclipped:
                term[t], grad[t] = -w * clip, 0.0
                clipped += 1
            else:
                term[t], grad[t] = -w * unclipped, -w * A * r
            if cfg.loss == "ppo":
                w = r
        weights.append(w)
        d = ref[t] - x
        k = math.exp(d) - d - 1
        kg = 1 - math.exp(d)
        if k > cfg.kl_clamp:
            k, kg = cfg.kl_clamp, 0.0
        kls.append(k)
        term[t] += cfg.kl_coef * k
        grad[t] += cfg.kl_coef * kg
        term[t] -= cfg.entropy_coef * H[t]
        ents.append(H[t])
    how = "sequences" if cfg.normalization == "auto" else cfg.normalization  # auto: sequences for these losses
    if how == "sequence_length":
        n_s = [sum(mask[t] for t in range(T) if sidx[t] == s) for s in range(len(b.seq_lens))]
        scale = [1 / n_s[sidx[t]] / b.num_samples_in_step if mask[t] else 0.0 for t in range(T)]
    else:
        denom = b.num_samples_in_step if how == "sequences" else b.num_tokens_in_step
        scale = [1 / denom] * T
    loss = sum(term[t] * scale[t] for t in range(T))
    grad = [grad[t] * scale[t] for t in range(T)]
    N = len(ratios)
    stats = {"loss": loss, "tokens": N, "ratio_mean": sum(ratios) / N, "ratio_max": max(ratios),
             "clip_frac": clipped / N, "mask_frac": masked / N, "kl": sum(kls) / N, "entropy": sum(ents) / N,
             "ess": sum(weights) ** 2 / (N * sum(w * w for w in weights))}
    return loss, grad, stats


def run(cfg, batch, logp, entropy):
    x = logp.clone().requires_grad_(True)
    loss, stats = make_loss(cfg)(x, batch, entropy)
    loss.backward()
    return loss, x.grad, stats


def check(cfg, batch, logp, entropy):
    loss, grad, stats = run(cfg, batch, logp, entropy)
    ref_loss, ref_grad, ref_stats = reference(cfg, batch, logp, entropy)
    assert loss.dim() == 0 and loss.dtype == torch.float64
    assert loss.item() == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
    assert grad.tolist() == pytest.approx(ref_grad, rel=1e-10, abs=1e-12)
    for k, v in ref_stats.items():
        assert stats[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    return stats


SEQ, PROMPT = [9, 14, 6, 21, 11], [4, 5, 6, 3, 1]  # sample 2 is an empty completion (all prompt)
CONFIGS = [
    dict(loss="grpo"),
    dict(loss="grpo", is_cap=INF),
    dict(loss="grpo", is_cap=0.0),
    dict(loss="grpo", is_cap=1.1, kl_coef=0.3, kl_clamp=0.5, entropy_coef=0.01),
    dict(loss="ppo"),
    dict(loss="ppo", clip_low=0.1, clip_high=0.28, kl_coef=0.1),
    dict(loss="decoupled_ppo", behaviour_cap=1.5, behaviour_cap_mode="mask"),
    dict(loss="decoupled_ppo", behaviour_cap=1.5, behaviour_cap_mode="clamp", entropy_coef=0.05),
    dict(loss="grpo", is_level="sequence"),
    dict(loss="grpo", is_level="sequence", is_cap=INF),
    dict(loss="aipo", aipo_rho=1.3),
    dict(loss="aipo", aipo_rho=1.3, is_level="sequence"),
    dict(loss="aipo", aipo_rho=4.0, kl_coef=1.0, kl_clamp=2.0),
]


@pytest.mark.parametrize("normalization", ["sequences", "tokens", "sequence_length"])
@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_loss_and_grad_match_reference(kw, normalization):
    cfg = AlgoConfig(normalization=normalization, **kw)
    batch, logp, ent = make_batch(SEQ, PROMPT, seed=len(str(kw)), n_seq=7, n_tok=80)
    stats = check(cfg, batch, logp, ent)
    # the random inputs exercise the interesting branches, or the test would prove little
    if cfg.loss in ("ppo", "decoupled_ppo"):
        assert 0 < stats["clip_frac"] < 1
    if cfg.loss == "decoupled_ppo":
        assert 0 < stats["masked"] or cfg.behaviour_cap_mode == "clamp"
    if cfg.is_level == "sequence":  # some samples' products pass the cap, some stay under it
        tok = AlgoConfig(**{**kw, "is_level": "token"}, normalization=normalization)
        assert stats["ess"] != pytest.approx(check(tok, batch, logp, ent)["ess"])
    assert make_loss(cfg).needs_entropy == (cfg.entropy_coef > 0)


def _two_token_batch(logp, mu, adv, prox=None):
    """Two samples of 2 tokens each, one trained token per sample (float64)."""
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return TrainBatch(
        input_ids=torch.zeros(4, dtype=torch.long), position_ids=torch.tensor([0, 1, 0, 1]), seq_lens=[2, 2],
        loss_mask=t([0, 1, 0, 1]), advantages=t([adv[0]] * 2 + [adv[1]] * 2),
        behaviour_logprobs=t([0, mu[0], 0, mu[1]]), versions=torch.zeros(4, dtype=torch.long),
        sample_index=torch.tensor([0, 0, 1, 1]), num_samples_in_step=2, num_tokens_in_step=2,
        prox_logprobs=None if prox is None else t([0, prox[0], 0, prox[1]]),
    ), t([0, logp[0], 0, logp[1]])


def test_ratio_exactly_at_clip_boundary_is_not_clipped():
    mu, x_hi, x_lo = -1.0, -0.8, -1.25
    r_hi = float(torch.exp(torch.tensor(x_hi - mu, dtype=torch.float64)))
    r_lo = float(torch.exp(torch.tensor(x_lo - mu, dtype=torch.float64)))
    eps_high, eps_low = r_hi - 1, 1 - r_lo
    assert 1 + eps_high == r_hi and 1 - eps_low == r_lo  # the ratios are exactly on the bounds
    cfg = AlgoConfig(loss="ppo", clip_low=eps_low, clip_high=eps_high)
    # A > 0 at the upper bound, A < 0 at the lower bound: the only sides where clipping can act
    batch, logp = _two_token_batch([x_hi, x_lo], [mu, mu], [1.5, -2.0])
    loss, grad, stats = run(cfg, batch, logp, None)
    assert stats["clipped"] == 0
    assert loss.item() == pytest.approx(-(r_hi * 1.5 + r_lo * -2.0) / 2, rel=1e-14)
    assert grad.tolist() == pytest.approx([0, -1.5 * r_hi / 2, 0, 2.0 * r_lo / 2], rel=1e-14)
    # a hair further out: clipped, constant term, zero gradient
    beyond = [x_hi + 1e-12, x_lo - 1e-12]
    batch, logp = _two_token_batch(beyond, [mu, mu], [1.5, -2.0])
    loss, grad, stats = run(cfg, batch, logp, None)
    assert stats["clipped"] == 2 and grad.abs().sum() == 0
    assert loss.item() == pytest.approx(-((1 + eps_high) * 1.5 + (1 - eps_low) * -2.0) / 2, rel=1e-14)


def test_masked_tokens_ignore_garbage_and_get_no_gradient():
    cfg = AlgoConfig(loss="ppo", kl_coef=0.5)
    batch, logp, ent = make_batch(SEQ, PROMPT, seed=3)
    clean = run(cfg, batch, logp, ent)
    off = batch.loss_mask == 0
    dirty_logp = torch.where(off, torch.tensor(1e4, dtype=torch.float64), logp)
    for name, value in [("behaviour_logprobs", -1e4), ("ref_logprobs", float("nan")), ("advantages", 1e30)]:
        setattr(batch, name, torch.where(off, torch.tensor(value, dtype=torch.float64), getattr(batch, name)))
    dirty = run(cfg, batch, dirty_logp, ent)
    assert dirty[0].item() == clean[0].item() and math.isfinite(dirty[0].item())
    assert torch.equal(dirty[1], clean[1]) and dirty[1][off].abs().sum() == 0
    assert dirty[2]["tokens"] == float((~off).sum())


def test_empty_completion_adds_nothing():
    cfg = AlgoConfig(loss="grpo", normalization="sequence_length")
    batch, logp, ent = make_batch([5, 4, 6], [2, 4, 3], seed=1)  # sample 1 has no trained token
    loss, grad, _ = run(cfg, batch, logp, ent)
    assert math.isfinite(loss.item()) and grad[5:9].abs().sum() == 0
    check(cfg, batch, logp, ent)
    # an all-prompt micro-batch: zero loss, zero stats, no NaN
    batch, logp, ent = make_batch([4, 3], [4, 3], seed=2)
    for norm in ("sequences", "tokens", "sequence_length"):
        loss, grad, stats = run(AlgoConfig(loss="decoupled_ppo", normalization=norm), batch, logp, ent)
        assert loss.item() == 0 and grad.abs().sum() == 0 and stats["tokens"] == 0 and stats["ess"] == 0


def test_zero_token_micro_batch():
    e = lambda dt=torch.float64: torch.zeros(0, dtype=dt)  # noqa: E731
    el = torch.zeros(0, dtype=torch.long)
    batch = TrainBatch(input_ids=el, position_ids=el, seq_lens=[], loss_mask=e(torch.float32), advantages=e(),
                       behaviour_logprobs=e(), versions=el, sample_index=el, num_samples_in_step=4,
                       num_tokens_in_step=0, prox_logprobs=e())
    for norm in ("sequences", "tokens", "sequence_length"):
        x = e().requires_grad_(True)
        loss, stats = make_loss(AlgoConfig(loss="decoupled_ppo", normalization=norm))(x, batch, None)
        loss.backward()
        assert loss.item() == 0 and stats["tokens"] == 0 and stats["ratio_max"] == 0


def test_behaviour_cap_mask_drops_and_clamp_caps():
    # token 0: pi_prox/mu = e^1 > cap 2; token 1: e^0.5 < cap. u = pi/pi_prox = e^0.1 (inside the clip)
    prox, mu = [-1.0, -1.0], [-2.0, -1.5]
    batch, logp = _two_token_batch([-0.9, -0.9], mu, [1.0, 1.0], prox=prox)
    u, b0, b1 = math.exp(0.1), math.exp(1.0), math.exp(0.5)
    assert abs(u - 1) < 0.2 and b0 > 2 > b1
    loss, grad, st = run(AlgoConfig(loss="decoupled_ppo", behaviour_cap=2.0, behaviour_cap_mode="mask"), batch, logp,
                         None)
    assert loss.item() == pytest.approx(-b1 * u / 2) and grad[1] == 0 and grad[3] == pytest.approx(-b1 * u / 2)
    assert st["masked"] == 1 and st["mask_frac"] == 0.5 and st["ess"] == pytest.approx(b1**2 / (2 * b1**2))
    loss, grad, st = run(AlgoConfig(loss="decoupled_ppo", behaviour_cap=2.0, behaviour_cap_mode="clamp"), batch,
                         logp, None)
    assert loss.item() == pytest.approx(-(2.0 * u + b1 * u) / 2) and grad[1] == pytest.approx(-2.0 * u / 2)
    assert st["masked"] == 0 and st["ess"] == pytest.approx((2 + b1) ** 2 / (2 * (4 + b1**2)))


def _split(batch: TrainBatch, logp, ent, k: int):
    """The same step as two micro-batches: samples [0, k) and [k, n), with sample_index restarting at 0."""
    cut = sum(batch.seq_lens[:k])
    parts = []
    for lo, hi, lens, off in [(0, cut, batch.seq_lens[:k], 0), (cut, batch.num_tokens, batch.seq_lens[k:], k)]:
        sl = lambda x: None if x is None else x[lo:hi]  # noqa: E731
        mb = TrainBatch(
            input_ids=sl(batch.input_ids), position_ids=sl(batch.position_ids), seq_lens=lens,
            loss_mask=sl(batch.loss_mask), advantages=sl(batch.advantages),
            behaviour_logprobs=sl(batch.behaviour_logprobs), versions=sl(batch.versions),
            sample_index=sl(batch.sample_index) - off, num_samples_in_step=batch.num_samples_in_step,
            num_tokens_in_step=batch.num_tokens_in_step, prox_logprobs=sl(batch.prox_logprobs),
            ref_logprobs=sl(batch.ref_logprobs),
        )
        parts.append((mb, sl(logp), sl(ent)))
    return parts


@pytest.mark.parametrize("normalization", ["sequences", "tokens", "sequence_length"])
@pytest.mark.parametrize("loss", ["grpo", "decoupled_ppo"])
def test_micro_batches_sum_to_the_step_loss(loss, normalization):
    cfg = AlgoConfig(loss=loss, normalization=normalization, kl_coef=0.2, entropy_coef=0.01, behaviour_cap=1.5)
    batch, logp, ent = make_batch(SEQ, PROMPT, seed=5)
    whole_loss, whole_grad, whole_stats = run(cfg, batch, logp, ent)
    parts = [run(cfg, mb, lp, e) for mb, lp, e in _split(batch, logp, ent, 2)]
    assert (parts[0][0] + parts[1][0]).item() == pytest.approx(whole_loss.item(), rel=1e-12)
    assert torch.cat([p[1] for p in parts]).tolist() == pytest.approx(whole_grad.tolist(), rel=1e-12, abs=1e-15)
    merged = merge_stats([p[2] for p in parts])
    for k in ("loss", "tokens", "ratio_mean", "ratio_max", "clip_frac", "mask_frac", "ess", "kl", "entropy"):
        assert merged[k] == pytest.approx(whole_stats[k], rel=1e-12), k


def test_float32_logprobs_work_and_keep_their_dtype():
    batch, logp, ent = make_batch(SEQ, PROMPT, seed=6)
    x = logp.float().requires_grad_(True)
    loss, _ = make_loss(AlgoConfig())(x, batch, None)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert loss.item() == pytest.approx(reference(AlgoConfig(), batch, logp, ent)[0], rel=1e-5)


def test_clear_errors():
    batch, logp, ent = make_batch(SEQ, PROMPT, seed=7)
    batch.prox_logprobs = None
    with pytest.raises(ValueError, match="prox_logprobs"):
        make_loss(AlgoConfig(loss="decoupled_ppo"))(logp, batch, None)
    batch.ref_logprobs = None
    with pytest.raises(ValueError, match="ref_logprobs"):
        make_loss(AlgoConfig(kl_coef=0.1))(logp, batch, None)
    with pytest.raises(ValueError, match="entropy"):
        make_loss(AlgoConfig(entropy_coef=0.1))(logp, batch, None)
    with pytest.raises(ValueError, match="shape"):
        make_loss(AlgoConfig())(logp[:-1], batch, None)
    batch.num_tokens_in_step = 3  # fewer than this micro-batch trains: the trainer counted wrong
    with pytest.raises(ValueError, match="whole step"):
        make_loss(AlgoConfig(normalization="tokens"))(logp, batch, None)
    make_loss(AlgoConfig(normalization="sequences"))(logp, batch, None)  # not used by this normalisation
    batch.num_samples_in_step = 2
    with pytest.raises(ValueError, match="whole step"):
        make_loss(AlgoConfig(normalization="sequences"))(logp, batch, None)
    for bad in [dict(loss="dapo"), dict(normalization="batch"), dict(behaviour_cap_mode="drop"), dict(is_cap=-1.0),
                dict(aipo_rho=0.0), dict(is_level="sample"), dict(is_level="sequence", loss="ppo")]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_loss(AlgoConfig(**bad))


def test_lag_stats():
    def sample(prompt: int, versions: list[int]) -> Sample:
        return Sample(group_id="g", prompt_ids=[1] * prompt, completion_ids=[2] * len(versions),
                      logprobs=[0.0] * len(versions), versions=versions)

    # no prompt: the first completion token is not trained, so its version (0) does not count
    got = lag_stats([sample(2, [3, 3, 5]), sample(0, [0, 6, 6])], 6)
    assert got == {"lag_min": 0, "lag_mean": (3 + 3 + 1 + 0 + 0) / 5, "lag_max": 3, "lag_tokens": 5,
                   "lag_hist": {"0": 2, "1": 1, "3": 2}}
    rng = random.Random(0)
    vs = [[rng.randint(0, 9) for _ in range(rng.randint(1, 6))] for _ in range(10)]
    lags = [9 - v for row in vs for v in row]
    got = lag_stats([sample(1, row) for row in vs], 9)
    assert got["lag_mean"] == pytest.approx(sum(lags) / len(lags)) and got["lag_max"] == max(lags)
    assert lag_stats([], 2)["lag_tokens"] == 0
