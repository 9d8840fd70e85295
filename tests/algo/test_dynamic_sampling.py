"""Dynamic sampling's accounting (algo/dynamic_sampling.py): which groups are dropped, the tries of a place, the
trainer's start order passing over dropped groups without waiting for them, and a step record's figures."""

from __future__ import annotations

import random

import pytest
import torch

from inflight.algo.dynamic_sampling import CAPPED, DROP, KEEP, Refill, informative, refill_stats
from inflight.config import RunConfig
from inflight.config.actor import ActorConfig
from inflight.config.limits import staleness
from inflight.config.trainer import TrainerConfig
from inflight.contracts import Sample
from inflight.report.metrics import MetricsLogger
from inflight.streams.memory import MemoryStream
from inflight.trainer.loop.ordering import StartOrder
from inflight.trainer.loop.trainer_loop import TrainerLoop
from inflight.trainer.single import SingleDeviceTrainer

torch.set_num_threads(1)


def group(index: int, rewards: list[float], *, dropped: bool = False, n: int = 3, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed * 1000 + index)
    prompt = [rng.randrange(4, 60) for _ in range(4)]
    meta = {"group_index": index, **({"dropped": True} if dropped else {})}
    return [Sample(group_id=f"g{index}", prompt_ids=prompt, completion_ids=[rng.randrange(4, 60) for _ in range(n)],
                   logprobs=[-1.0] * n, versions=[0] * n, reward=r, meta=dict(meta)) for r in rewards]


def test_a_group_is_informative_when_its_rewards_differ():
    assert informative([1.0, 0.0]) and informative([0.5, 0.5, 0.25])
    assert not informative([1.0, 1.0, 1.0]) and not informative([0.0] * 4) and not informative([0.3])


def test_a_dropped_place_is_tried_again_up_to_max_tries_then_kept():
    r = Refill(max_tries=3)
    assert r.next_try() == 1
    assert r.judge(group(0, [1.0, 0.0]), 1) == KEEP
    assert r.judge(group(1, [1.0, 1.0]), 1) == DROP
    g2 = group(2, [0.0, 0.0])
    assert r.judge(g2, 1) == DROP  # a fresh place: its first try
    assert all(s.meta["dropped"] for s in g2)
    assert r.next_try() == 2 and r.next_try() == 2 and r.next_try() == 1  # owed oldest first, then fresh places
    assert r.judge(group(3, [1.0, 1.0]), 2) == DROP
    t = r.next_try()
    assert t == 3
    g4 = group(4, [1.0, 1.0])
    assert r.judge(g4, t) == CAPPED and all(s.meta["capped"] and "dropped" not in s.meta for s in g4)
    assert (r.dropped, r.capped, r.dropped_tokens) == (3, 1, 3 * 2 * 3)
    r.failed(2)  # a failure is not a try: the place keeps its count
    r.failed(1)
    assert r.next_try() == 2 and r.next_try() == 1
    assert Refill(max_tries=0).judge(group(5, [1.0, 1.0]), 10 ** 6) == DROP  # 0: no limit


def test_start_order_passes_over_dropped_groups_without_waiting_for_them():
    order = StartOrder(hole_timeout_s=1e9)
    order.add([group(0, [1, 0]), group(1, [1, 1], dropped=True), group(3, [0, 1]), group(2, [0, 0], dropped=True)])
    assert len(order) == 4 and order.live == 2  # dropped groups are held, but not as groups to train
    got = order.take(2, live_cap=100)
    assert [g[0].meta["group_index"] for g in got] == [0, 3]
    assert order.taken == 2 and order.dropped == 2 and order.next_index == 4
    assert order.pop_passed() == [(1, 6), (2, 6)] and order.pop_passed() == []
    # a hole (group 4 failed) is skipped once every live group the actor may have started is here: the dropped
    # groups gave their slots back, so they do not count toward that
    order.add([group(5, [1, 1], dropped=True), group(6, [1, 0])])
    assert order.take(1, live_cap=4) == []  # taken 2 + live 1 < 4: group 4 may still come
    assert [g[0].meta["group_index"] for g in order.take(1, live_cap=3)] == [6]
    assert order.skipped == [4] and order.dropped == 3


def test_dynamic_sampling_config():
    with pytest.raises(ValueError, match="group_size >= 2"):
        ActorConfig(dynamic_sampling=True, group_size=1)
    with pytest.raises(ValueError, match="max_tries"):
        ActorConfig(dynamic_sampling_max_tries=-1)
    cfg = RunConfig()
    assert staleness(cfg).queue_ahead == cfg.actor.queue_ahead == 1
    cfg.actor.dynamic_sampling = True  # nothing may wait at a server for a later version (config/limits.py)
    assert staleness(cfg).queue_ahead == 0


def test_refill_stats():
    passed = [(1, 6), (4, 9)]
    samples = [s for k in (0, 2) for s in group(k, [1.0, 0.0])]
    samples[-1].meta["capped"] = True
    st = refill_stats(passed, samples, 2)
    assert st == {"groups_dropped": 2, "groups_generated": 4, "dropped_frac": 0.5, "tokens_dropped": 15,
                  "tokens_dropped_frac": 15 / (15 + 12), "groups_capped": 1, "dropped_group_indices": [1, 4]}


def test_trainer_step_holds_groups_per_step_informative_groups(tiny_model_dir, tmp_path):
    """The trainer loop takes groups_per_step groups with a signal per step, whatever the dropped groups between
    them, and logs what it passed over."""
    cfg = RunConfig()
    cfg.actor.group_size, cfg.actor.groups_per_step, cfg.actor.dynamic_sampling = 2, 2, True
    cfg.pipeline.mode, cfg.pipeline.num_grad_steps, cfg.pipeline.max_steps = "sync", 1000, 2  # no push
    policy = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(threads=1, lr=1e-3, micro_batch_tokens=40))
    policy.init()
    log = MetricsLogger(tmp_path, "trainer")
    loop = TrainerLoop(cfg, policy, MemoryStream(), None, log, tmp_path)
    rewards = [[1, 1], [0, 1], [0, 0], [0, 0], [1, 0], [1, 1], [0, 1], [1, 0]]
    loop.stream.put([group(k, r, dropped=len(set(r)) == 1) for k, r in enumerate(rewards)])
    a, b = loop.step(), loop.step()
    log.close()
    assert a["group_indices"] == [1, 4] and a["dropped_group_indices"] == [0, 2, 3]
    assert b["group_indices"] == [6, 7] and b["dropped_group_indices"] == [5]
    for r, d in ((a, 3), (b, 1)):
        assert r["samples"] == r["trained_samples"] == 4 and r["groups_dropped"] == d
        assert r["groups_generated"] == 2 + d and r["dropped_frac"] == d / (2 + d) and r["tokens_dropped"] == 6 * d
    state = loop.checkpoint_state()  # a resume rebases on the groups trained: dropped ones gave their slots back
    assert (state.next_group, state.dropped_groups, state.groups_trained) == (8, 4, 4)
    again = TrainerLoop(cfg, policy, MemoryStream(), None, MetricsLogger(tmp_path / "r", "trainer"), tmp_path,
                        resume=state)
    assert (again.order.next_index, again.order.taken, again.order.dropped) == (8, 4, 4)
