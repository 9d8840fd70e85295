"""inflight.heap: with the setting, a trainer's steps stop page-faulting their memory in again."""

import os
import subprocess
import sys

import pytest

CHILD = r"""
import random, resource, sys, torch
from inflight.heap import retain_freed_memory
ok = retain_freed_memory()
from inflight.algo.config import AlgoConfig
from inflight.algo.losses import make_loss
from inflight.contracts import Sample
from inflight.trainer.config import TrainerConfig
from inflight.trainer.packing import count_loss_tokens, pack_samples
from inflight.trainer.single import SingleDeviceTrainer
t = SingleDeviceTrainer(sys.argv[1], TrainerConfig(threads=1, micro_batch_tokens=4096))
t.init()
rng, vocab = random.Random(0), t.model.config.vocab_size
samples = [Sample(f"s{i}", [rng.randrange(3, vocab) for _ in range(14)], [rng.randrange(3, vocab) for _ in range(10)],
                  [-1.0] * 10, [0] * 10) for i in range(128)]
adv, loss, n = [rng.random() - 0.5 for _ in samples], make_loss(AlgoConfig()), count_loss_tokens(samples)
def step():
    for mb in pack_samples(samples, adv, 4096, len(samples), n):
        t.backward(mb, loss)
    t.optimizer_step()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(int(ok), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(model_dir, keep: str) -> tuple[int, int]:
    env = {**os.environ, "INFLIGHT_KEEP_FREED_MEMORY": keep, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(model_dir)], env=env, capture_output=True, text=True,
                         check=True)
    ok, faults = map(int, out.stdout.split()[-2:])
    return ok, faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_training_steps_reuse_freed_memory(tiny_model_dir):
    (ok, kept), (off, given_back) = _faults(tiny_model_dir, "1"), _faults(tiny_model_dir, "0")
    assert ok == 1 and off == 0
    # 10 steps of 3,072 tokens: glibc handed the activations' memory back and faulted it in again every step
    assert given_back > 1000 and kept < given_back / 10, (kept, given_back)
