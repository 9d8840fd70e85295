"""REINFORCE++'s per-token advantages against a float64 reference written from the paper (Hu et al. 2025,
"REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Normalization", arXiv 2501.03262 v9):
    eq. 8   A_{q,o_t} = r(o_{1:T}, q) − β Σ_{i=t}^{T} KL(i)
    eq. 9   KL(t) = log(π_old(o_t | q, o_<t) / π_SFT(o_t | q, o_<t))        (k1; k2 = KL(t)² / 2 as an option)
    eq. 10  A^norm = (A − mean(A over the batch)) / std(A over the batch)   (every token of the global batch)
REINFORCE++-baseline: r − mean of its group's rewards first, then eq. 8-10."""

import math
import random

import pytest

from inflight.algo import AlgoConfig
from inflight.algo.reinforce_pp import base_rewards, mean_kl, step_advantages


def reference(groups, mu, ref, trained, beta, estimator, baseline, eps):
    """Plain loops; groups: rewards per group; mu / ref / trained: per sample (flattened over groups)."""
    r = []
    for g in groups:
        mean = sum(g) / len(g)
        r += [x - mean if baseline else x for x in g]
    returns = []
    for i, reward in enumerate(r):
        row = []
        for t in range(len(mu[i])):
            kl = 0.0
            for s in range(t, len(mu[i])):  # eq. 8: from t to the end, over the tokens the model sampled
                if trained[i][s]:
                    d = mu[i][s] - ref[i][s]
                    kl += d if estimator == "k1" else d * d / 2
            row.append(reward - beta * kl)
        returns.append(row)
    flat = [x for row, m in zip(returns, trained, strict=True) for x, on in zip(row, m, strict=True) if on]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    return [[(x - mean) / (std + eps) for x in row] for row in returns]


def random_step(seed):
    rng = random.Random(seed)
    groups = [[rng.choice([0.0, 1.0, rng.uniform(-1, 2)]) for _ in range(4)] for _ in range(3)]
    n = [rng.randint(1, 9) for _ in range(12)]
    mu = [[-rng.uniform(0.1, 3) for _ in range(k)] for k in n]
    ref = [[x + rng.gauss(0, 0.5) for x in row] for row in mu]
    trained = [[not (t == 0 and i % 3 == 0) and rng.random() > 0.15 for t in range(k)] for i, k in enumerate(n)]
    trained[0] = [False] * n[0]  # a sample with no trained token (an environment's tokens only)
    return groups, mu, ref, trained


@pytest.mark.parametrize("baseline", [False, True], ids=["reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("beta,estimator", [(0.0, "k1"), (0.05, "k1"), (0.3, "k2")])
def test_matches_the_paper(baseline, beta, estimator):
    cfg = AlgoConfig(advantage="reinforce_pp_baseline" if baseline else "reinforce_pp", kl_reward_coef=beta,
                     kl_reward_estimator=estimator, std_eps=1e-6)
    for seed in range(5):
        groups, mu, ref, trained = random_step(seed)
        rewards = [x for g in base_rewards(groups, cfg) for x in g]
        got = step_advantages(rewards, mu, ref if beta else None, trained, cfg)
        want = reference(groups, mu, ref, trained, beta, estimator, baseline, 1e-6)
        assert [len(row) for row in got] == [len(row) for row in mu]
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=1e-9, abs=1e-12)
        flat = [x for row, m in zip(got, trained, strict=True) for x, on in zip(row, m, strict=True) if on]
        assert abs(sum(flat)) < 1e-9  # normalised over the step's trained tokens: mean 0, std ~1
        assert math.sqrt(sum(x * x for x in flat) / len(flat)) == pytest.approx(1.0, abs=1e-5)


def test_the_kl_makes_advantages_differ_within_a_sample():
    cfg = AlgoConfig(advantage="reinforce_pp", kl_reward_coef=0.1)
    groups, mu, ref, trained = random_step(7)
    rewards = [x for g in groups for x in g]
    got = step_advantages(rewards, mu, ref, trained, cfg)
    assert any(len(set(row)) > 1 for row in got)
    plain = step_advantages(rewards, mu, None, trained, AlgoConfig(advantage="reinforce_pp"))
    assert all(len(set(row)) <= 1 for row in plain)  # without KL every token of a sample has the same advantage


def test_a_step_without_signal_gives_zeros_and_the_kl_needs_the_reference():
    cfg = AlgoConfig(advantage="reinforce_pp_baseline")
    assert step_advantages([0.0, 0.0], [[-1.0, -2.0], [-1.0]], None, [[True, True], [True]], cfg) == \
        [[0.0, 0.0], [0.0]]
    assert step_advantages([1.0], [[-1.0]], None, [[False]], cfg) == [[0.0]]
    with pytest.raises(ValueError, match="reference"):
        step_advantages([1.0], [[-1.0]], None, [[True]], AlgoConfig(advantage="reinforce_pp", kl_reward_coef=0.1))
    with pytest.raises(ValueError, match="non-finite"):
        base_rewards([[1.0, math.nan]], cfg)


def test_shares_summed_over_ranks_give_the_whole_steps_advantages():
    """FSDP2: each rank passes its share of the step with `total`, a sum over the ranks (here 3 threads and a
    barrier, one rank with no sample at all): every share's advantages and the mean KL equal the whole step's."""
    import threading

    cfg = AlgoConfig(advantage="reinforce_pp_baseline", kl_reward_coef=0.05)
    groups, mu, ref, trained = random_step(11)
    rewards = [x for g in base_rewards(groups, cfg) for x in g]
    whole = step_advantages(rewards, mu, ref, trained, cfg)
    whole_kl = mean_kl(mu, ref, trained, "k1")
    shares = [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7], []]  # groups 0 and 2, group 1, nothing
    barrier, lock, parts, got = threading.Barrier(len(shares)), threading.Lock(), [], {}

    def total(values):  # every rank's list, summed element-wise: what all_reduce does over the gloo group
        with lock:
            parts.append(list(values))
        barrier.wait()
        out = [math.fsum(p[k] for p in parts) for k in range(len(values))]
        if barrier.wait() == 0:  # every rank has read the sums
            parts.clear()
        barrier.wait()
        return out

    def rank(r):
        idx = shares[r]
        pick = lambda rows: [rows[i] for i in idx]  # noqa: E731
        kl = mean_kl(pick(mu), pick(ref), pick(trained), "k1", total)
        got[r] = (step_advantages(pick(rewards), pick(mu), pick(ref), pick(trained), cfg, total), kl)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(shares))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(got) == [0, 1, 2]
    for r, idx in enumerate(shares):
        adv, kl = got[r]
        assert kl == pytest.approx(whole_kl, rel=1e-12, abs=1e-15)
        assert len(adv) == len(idx)
        for i, row in zip(idx, adv, strict=True):
            assert row == pytest.approx(whole[i], rel=1e-12, abs=1e-12)
