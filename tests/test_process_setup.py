"""inflight.process: with the setting, memory a process frees stays mapped for its next tensors (no page faults to
bring it back); without it, glibc gives a large freed block back to the OS at once."""

import os
import subprocess
import sys

import pytest

CHILD = r"""
import torch
from inflight.process import retain_freed_memory
ok = retain_freed_memory()
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
base = rss_mb()
x = torch.ones(6 << 20)  # 24 MB, written: resident
held = rss_mb()
del x
print(int(ok), held - base, rss_mb() - base)
"""


def _rss(keep: str) -> tuple[int, float, float]:
    env = {**os.environ, "INFLIGHT_KEEP_FREED_MEMORY": keep, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    ok, held, after = out.stdout.split()[-3:]
    return int(ok), float(held), float(after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")
def test_freed_memory_stays_with_the_process():
    ok, held, after = _rss("1")
    assert ok == 1 and held > 20 and after > 20  # 24 MB resident while held, and still after the free
    off, held, after = _rss("0")
    assert off == 0 and held > 20 and after < 4  # glibc's default: the block is unmapped at the free


FREEZE = r"""
import gc, time
import torch, transformers  # a role process's start-up objects: hundreds of thousands
from inflight.process import freeze_startup_objects
def full_collection_s():
    t = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t
before, tracked = full_collection_s(), len(gc.get_objects())
freeze_startup_objects()
garbage = [[i] for i in range(1000)]  # made later: still tracked and collected as before
print(tracked, len(gc.get_objects()), before, full_collection_s())
"""


def test_startup_objects_leave_the_full_collections():
    out = subprocess.run([sys.executable, "-c", FREEZE], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True)
    tracked, after, before_s, after_s = out.stdout.split()[-4:]
    assert int(tracked) > 50_000 and 1000 <= int(after) < 5_000  # only what was made since is walked
    assert float(after_s) < float(before_s) / 5
