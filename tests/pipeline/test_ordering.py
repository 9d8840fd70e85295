"""Start-order delivery of groups to the trainer (the staleness bound depends on it)."""

from inflight.contracts import Sample
from inflight.trainer.loop.ordering import StartOrder


def g(k: int | None):
    meta = {} if k is None else {"group_index": k}
    return [Sample(group_id=f"g{k}", prompt_ids=[1], completion_ids=[2], logprobs=[0.0], versions=[0], meta=meta)]


def idx(groups):
    return [x[0].meta.get("group_index") for x in groups]


def test_groups_come_back_in_start_order():
    o = StartOrder(hole_timeout_s=1e9)
    o.add([g(2), g(0)])
    assert idx(o.take(3, now=0)) == [0]  # 1 is still running: 2 waits for it
    o.add([g(1), g(3)])
    assert idx(o.take(2, now=0)) == [1, 2]
    o.add([g(1)])  # a duplicate delivery is ignored
    assert idx(o.take(5, now=0)) == [3] and len(o) == 0


def test_missing_index_is_skipped_only_when_nothing_else_can_be_in_flight():
    o = StartOrder(hole_timeout_s=1e9)
    o.add([g(0), g(2), g(3)])
    assert idx(o.take(4, live_cap=4, now=0)) == [0]  # taken 1 + buffered 2 < 4: group 1 may still come
    o.add([g(4)])  # the actor started a replacement: only possible if group 1 was given up
    assert idx(o.take(4, live_cap=4, now=0)) == [2, 3, 4] and o.skipped == [1]


def test_hole_timeout_is_the_last_resort():
    o = StartOrder(hole_timeout_s=10)
    o.add([g(1)])
    assert o.take(1, now=0) == []
    assert o.take(1, now=5) == []
    assert idx(o.take(1, now=11)) == [1] and o.skipped == [0]


def test_groups_without_index_keep_arrival_order():
    o = StartOrder()
    o.add([g(None), g(None)])
    assert len(o.take(5)) == 2
