"""Advantages against plain float64 loops."""

import math
import random

import pytest

from inflight.algo import AlgoConfig, compute_advantages


def reference(group: list[float], advantage: str, normalize_std: bool, eps: float) -> list[float]:
    G = len(group)
    out = []
    for i in range(G):
        if advantage == "group_mean":
            base = sum(group) / G
        else:
            others = [group[j] for j in range(G) if j != i]
            base = sum(others) / len(others)
        out.append(group[i] - base)
    if normalize_std:
        mean = sum(group) / G
        var = sum((x - mean) ** 2 for x in group) / G
        out = [a / (math.sqrt(var) + eps) for a in out]
    return out


@pytest.mark.parametrize("advantage", ["group_mean", "leave_one_out"])
@pytest.mark.parametrize("normalize_std", [False, True])
def test_matches_reference_on_random_groups(advantage, normalize_std):
    rng = random.Random(0)
    groups = [[rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in range(rng.randint(2, 9))] for _ in range(50)]
    cfg = AlgoConfig(advantage=advantage, normalize_std=normalize_std, std_eps=1e-4)
    got = compute_advantages(groups, cfg)
    assert [len(g) for g in got] == [len(g) for g in groups]
    for g, a in zip(groups, got):
        if len(set(g)) == 1:
            assert a == [0.0] * len(g)
        else:
            assert a == pytest.approx(reference(g, advantage, normalize_std, 1e-4), rel=1e-12, abs=1e-12)


def test_known_values():
    r = [[1.0, 0.0, 0.0, 0.0]]
    assert compute_advantages(r, AlgoConfig()) == [[0.75, -0.25, -0.25, -0.25]]
    loo = compute_advantages(r, AlgoConfig(advantage="leave_one_out"))[0]
    assert loo == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    std = compute_advantages(r, AlgoConfig(normalize_std=True, std_eps=0.0 + 1e-12))[0]
    assert std == pytest.approx([0.75 / math.sqrt(3 / 16), -0.25 / math.sqrt(3 / 16)] + [-0.25 / math.sqrt(3 / 16)] * 2)


@pytest.mark.parametrize("advantage", ["group_mean", "leave_one_out"])
@pytest.mark.parametrize("normalize_std", [False, True])
def test_all_equal_rewards_give_exact_zero(advantage, normalize_std):
    # 0.1 * 3 / 3 != 0.1 in floats: a naive r - mean leaves a residue that std normalisation would blow up
    groups = [[0.1, 0.1, 0.1], [1.0] * 8, [0.0, 0.0], [0.7], []]
    got = compute_advantages(groups, AlgoConfig(advantage=advantage, normalize_std=normalize_std))
    assert got == [[0.0] * 3, [0.0] * 8, [0.0] * 2, [0.0], []]


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="advantage"):
        compute_advantages([[0.0, 1.0]], AlgoConfig(advantage="median"))
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages([[0.0, float("nan")]], AlgoConfig())
