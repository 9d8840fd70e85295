"""Make the default process group refuse CPU tensors from inflight's code, as NCCL (the default group on CUDA)
does, so the CPU FSDP2 tests fail wherever inflight sends a host tensor to the default group instead of the
trainer's gloo cpu_group. torch's own calls (FSDP, set_model_state_dict) pass: on CPU their device tensors are CPU
tensors, on CUDA they are CUDA tensors. Call in a rank process before the trainer starts.

`run_ranks` starts a worker script as the ranks of one gloo group, as torchrun would, from the test process."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import pytest
import torch
import torch.distributed as dist

from tests.reliability.pipeline_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]

REFUSED: list[str] = []


def default_group_refuses_cpu_tensors() -> None:
    def guard(name, real):
        def call(tensor, *args, group=None, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if (tensor.device.type == "cpu" and (group is None or group is dist.group.WORLD)
                    and caller.startswith("inflight")):
                REFUSED.append(name)
                raise RuntimeError(f"{name} of a CPU tensor on the default group (NCCL on CUDA has no CPU tensors)")
            return real(tensor, *args, group=group, **kwargs)
        return call

    for name in ("broadcast", "all_reduce"):
        setattr(dist, name, guard(name, getattr(dist, name)))
    real_barrier = dist.barrier

    def barrier(group=None, **kwargs):  # on NCCL it needs the device set; ours go to the gloo group
        if (group is None or group is dist.group.WORLD) and sys._getframe(1).f_globals.get(
                "__name__", "").startswith("inflight"):
            REFUSED.append("barrier")
            raise RuntimeError("barrier on the default group; the trainer's barriers use cpu_group")
        return real_barrier(group=group, **kwargs)

    dist.barrier = barrier
    torch.distributed.barrier = barrier


def run_ranks(worker: str | Path, args: Sequence[object], world_size: int = 2, timeout: float = 240,
              hung: str = "FSDP2 ranks timed out", tail: int = 3000) -> list[str]:
    """Run `python worker *args` as ranks 0..world_size-1 (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and a free
    MASTER_PORT, one thread each) from the repository root; each rank's output (stdout and stderr). Fails the test
    naming a rank that exited non-zero (the others are stopped then: they would wait for it in a
    collective), or with `hung` when they are not all done within `timeout` seconds; with every rank's last output."""
    port = free_port()
    procs, outs = [], []
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            outs.append(tempfile.TemporaryFile(mode="w+"))  # a file, not a pipe: a chatty rank never blocks on it
            procs.append(subprocess.Popen([sys.executable, str(worker), *map(str, args)], env=env, cwd=ROOT,
                                          stdout=outs[-1], stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        codes = [p.poll() for p in procs]
        while None in codes and time.monotonic() < deadline and not any(codes):  # any(): a rank failed
            time.sleep(0.05)
            codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        logs = []
        for f in outs:
            f.seek(0)
            logs.append(f.read())
            f.close()
    ends = "\n".join(f"--- rank {r} ({'stopped' if c is None else f'exit {c}'})\n{log[-tail:]}"
                     for r, (c, log) in enumerate(zip(codes, logs, strict=True)))
    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
    if failed:
        pytest.fail(f"rank {failed[0]} of {world_size} exited with {codes[failed[0]]}\n{ends}")
    if None in codes:
        pytest.fail(f"{hung}\n{ends}")
    return logs
