"""GAE and PPO's clipped value loss (inflight/algo/gae.py) against float64 references written here from the papers:

- GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation", eq. 16,
  A_t = Σ_{l=0}^{∞} (γλ)^l δ_{t+l}, δ_t = r_t + γ V(s_{t+1}) − V(s_t) (eq. 10), V = 0 after the episode ends; the
  sum written out term by term (not the backward recursion the implementation uses);
- the clipped value loss of OpenAI baselines' ppo2 (baselines/ppo2/model.py): vpredclipped = V_old + clip(V − V_old,
  −ε, ε), loss = ½ · max((V − R)², (vpredclipped − R)²), as verl's compute_value_loss takes it;
- verl's whitening of GAE advantages (masked_whiten: unbiased variance, (A − mean) / sqrt(var + 1e-8)).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from inflight.algo import gae
from inflight.config.algo import AlgoConfig
from inflight.config.critic import CriticConfig


def reference_gae(reward: float, values: list[float], trained: list[bool], gamma: float, lam: float):
    """eq. 16 term by term over the trained tokens (the episode's time steps), reward on the last one."""
    steps = [t for t, on in enumerate(trained) if on]
    n = len(steps)
    r = [0.0] * n
    if n:
        r[-1] = reward
    v = [values[t] for t in steps] + [0.0]  # V after the last step: the episode has ended
    delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(n)]
    adv = [0.0] * len(trained)
    ret = [0.0] * len(trained)
    for k, t in enumerate(steps):
        adv[t] = sum((gamma * lam) ** m * delta[k + m] for m in range(n - k))
        ret[t] = adv[t] + v[k]
    return adv, ret


def random_case(seed: int, n_samples: int = 6):
    rng = random.Random(seed)
    rewards, values, trained = [], [], []
    for i in range(n_samples):
        c = rng.randint(1, 9)
        rewards.append(rng.choice([0.0, 1.0, rng.uniform(-2, 2)]))
        values.append([rng.uniform(-1.5, 1.5) for _ in range(c)])
        m = [rng.random() > 0.2 for _ in range(c)]  # some tokens an environment's, or a first token
        if i == 0:
            m = [False] * c  # a sample with nothing trained
        trained.append(m)
    return rewards, values, trained


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_eq16(gamma, lam, seed):
    rewards, values, trained = random_case(seed)
    for r, v, m in zip(rewards, values, trained, strict=True):
        adv, ret = gae.sample_gae(r, v, m, gamma, lam)
        ref_adv, ref_ret = reference_gae(r, v, m, gamma, lam)
        assert adv == pytest.approx(ref_adv, abs=1e-9)
        assert ret == pytest.approx(ref_ret, abs=1e-9)


def test_gamma_lambda_one_is_reward_minus_value():
    """γ = λ = 1 (verl's default): the sum telescopes to A_t = r − V(s_t), and every return is the reward."""
    adv, ret = gae.sample_gae(1.0, [0.2, 0.5, -0.3], [True, True, True], 1.0, 1.0)
    assert adv == pytest.approx([0.8, 0.5, 1.3], abs=1e-12)
    assert ret == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)


@pytest.mark.parametrize("whiten", [True, False])
def test_step_advantages_whitened_like_verl(whiten):
    rewards, values, trained = random_case(7, n_samples=8)
    cfg = AlgoConfig(advantage="gae", gamma=0.99, lam=0.95, gae_whiten=whiten)
    adv, ret = gae.step_advantages(rewards, values, trained, cfg)
    raw = [reference_gae(r, v, m, 0.99, 0.95) for r, v, m in zip(rewards, values, trained, strict=True)]
    flat = [a for (row, _), m in zip(raw, trained, strict=True) for a, on in zip(row, m, strict=True) if on]
    mean = sum(flat) / len(flat)
    var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)  # unbiased, as verl's masked_var
    for (ref_a, ref_r), a, r, m in zip(raw, adv, ret, trained, strict=True):
        want = [((x - mean) / math.sqrt(var + 1e-8) if whiten else x) if on else 0.0
                for x, on in zip(ref_a, m, strict=True)]
        assert a == pytest.approx(want, abs=1e-9)
        assert r == pytest.approx(ref_r, abs=1e-9)  # the value targets are never whitened
    if whiten:
        got = [x for row, m in zip(adv, trained, strict=True) for x, on in zip(row, m, strict=True) if on]
        assert sum(got) / len(got) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("clip", [0.0, 0.2, 0.5])
def test_clipped_value_loss_matches_baselines_ppo2(clip):
    rng = random.Random(3)
    n = 64
    v = [rng.uniform(-2, 2) for _ in range(n)]
    old = [x + rng.uniform(-1, 1) for x in v]
    ret = [rng.uniform(-2, 2) for _ in range(n)]
    values = torch.tensor(v, dtype=torch.float64, requires_grad=True)
    loss, clipped = gae.clipped_value_loss(values, torch.tensor(old, dtype=torch.float64),
                                           torch.tensor(ret, dtype=torch.float64), clip)
    loss.sum().backward()
    loss = loss.detach()
    assert values.grad is not None
    for i in range(n):
        l1 = (v[i] - ret[i]) ** 2
        if clip > 0:
            vclip = old[i] + min(max(v[i] - old[i], -clip), clip)
            l2 = (vclip - ret[i]) ** 2
            want, is_clipped = 0.5 * max(l1, l2), l2 > l1
            # the gradient: through V where the unclipped term is the larger, or the clipped V inside its band
            inside = -clip < v[i] - old[i] < clip
            grad = (v[i] - ret[i]) if not is_clipped else ((vclip - ret[i]) if inside else 0.0)
        else:
            want, is_clipped, grad = 0.5 * l1, False, v[i] - ret[i]
        assert float(loss[i]) == pytest.approx(want, abs=1e-9)
        assert bool(clipped[i]) == is_clipped
        assert float(values.grad[i]) == pytest.approx(grad, abs=1e-9)
    if clip > 0:
        assert clipped.any() and not clipped.all()  # both branches exercised


def test_explained_variance():
    values = [[0.1, 0.4], [0.9]]
    returns = [[0.0, 0.5], [1.0]]
    trained = [[True, True], [True]]
    r = [0.0, 0.5, 1.0]
    d = [-0.1, 0.1, 0.1]

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    assert gae.explained_variance(values, returns, trained) == pytest.approx(1 - var(d) / var(r), abs=1e-12)
    assert gae.explained_variance([[0.3, 0.3]], [[1.0, 1.0]], [[True, True]]) == 0.0  # returns constant


def test_check_refuses():
    critic = CriticConfig()
    with pytest.raises(ValueError, match="gamma"):
        gae.check(AlgoConfig(advantage="gae", gamma=1.5), critic)
    with pytest.raises(ValueError, match="normalize_std"):
        gae.check(AlgoConfig(advantage="gae", normalize_std=True), critic)
    with pytest.raises(ValueError, match="gspo"):
        gae.check(AlgoConfig(advantage="gae", loss="gspo"), critic)
    with pytest.raises(ValueError, match="mini_batches"):
        gae.check(AlgoConfig(advantage="gae"), CriticConfig(mini_batches=0))
    gae.check(AlgoConfig(advantage="gae", loss="ppo"), critic)
