"""run_ranks (cpu_collectives.py), the launcher of the FSDP2 tests' ranks: it gives each rank its environment,
names the rank that failed and stops the one left waiting for it, and fails a run that hangs."""

import time

import pytest

from .cpu_collectives import run_ranks

WORKER = """import os, sys, time
rank, mode = int(os.environ["RANK"]), sys.argv[1]
print(f"rank {rank} of {os.environ['WORLD_SIZE']} at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
if mode == "fail" and rank == 1:
    sys.exit("rank 1 gives up")
if mode != "ok":
    time.sleep(600)  # as a rank waiting in a collective for one that is gone
"""


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_every_rank_gets_its_environment(worker):
    logs = run_ranks(worker, ["ok"], world_size=3, timeout=60)
    port = {line.rsplit(":", 1)[1] for line in logs}
    assert [line.split(" at ")[0] for line in logs] == [f"rank {r} of 3" for r in range(3)]
    assert len(port) == 1  # one group: every rank meets at the same port


def test_a_failed_rank_is_named_and_the_waiting_one_stopped(worker):
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_ranks(worker, ["fail"], timeout=120)
    assert time.monotonic() - t0 < 60  # not the timeout: rank 0 was stopped once rank 1 had failed
    message = str(failed.value)
    assert message.startswith("rank 1 of 2 exited with 1")
    assert "rank 1 gives up" in message and "--- rank 0 (stopped)" in message


def test_a_hung_run_fails_with_its_message(worker):
    with pytest.raises(pytest.fail.Exception, match="^ranks hung here"):
        run_ranks(worker, ["hang"], timeout=3, hung="ranks hung here")
