"""Deterministic test groups (importable by spawned child processes: pytest puts this folder on sys.path)."""

from __future__ import annotations

import random
import struct

from inflight.contracts import Sample, Verdict


def make_group(index: int, group_size: int = 3, seed: int = 0) -> list[Sample]:
    """Group number `index`: random lengths, ids and float64 logprobs (full 53-bit mantissas)."""
    rng = random.Random(seed * 1_000_003 + index)
    group = []
    for j in range(group_size):
        n = rng.randint(0, 12)
        group.append(Sample(
            group_id=f"g{index}",
            prompt_ids=[rng.randint(0, 2**40) for _ in range(rng.randint(1, 9))],
            completion_ids=[rng.randint(0, 50_000) for _ in range(n)],
            logprobs=[-rng.expovariate(0.7) for _ in range(n)],
            versions=sorted(rng.randint(0, 9) for _ in range(n)),
            reward=rng.random(),
            label=Verdict.correct if j == 0 else "wrong",
            finish_reason=rng.choice(["stop", "length"]),
            task_id=f"t{index}",
            meta={"index": index, "j": j, "tags": ["a", 1, 2.5, None, True], "nested": {"x": b"\x00\xff"}},
        ))
    return group


def bits(xs: list[float]) -> list[bytes]:
    return [struct.pack("<d", x) for x in xs]


def same_group(a: list[Sample], b: list[Sample]) -> bool:
    """Field by field, logprobs and reward compared bit for bit; a Verdict label compares equal to its value."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x.group_id, x.prompt_ids, x.completion_ids, x.versions, x.finish_reason, x.task_id, x.meta) != (
            y.group_id, y.prompt_ids, y.completion_ids, y.versions, y.finish_reason, y.task_id, y.meta
        ):
            return False
        if bits(x.logprobs) != bits(y.logprobs) or bits([x.reward]) != bits([y.reward]):
            return False
        if str(getattr(x.label, "value", x.label)) != y.label:
            return False
    return True
