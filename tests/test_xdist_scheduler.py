"""tests/conftest.py's pytest_xdist_make_scheduler: under `--dist loadfile` (make test) a test file is one unit of
work and each of ONE_WORKER_FOLDERS is one unit (all its files on one worker, one after another); other --dist modes
keep xdist's own scheduler. Driven through xdist's real scheduler with two stand-in workers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from xdist.remote import Producer

from tests.conftest import ONE_WORKER_FOLDERS, pytest_xdist_make_scheduler

pytest_plugins = ["pytester"]
QUIET = Producer("sched", enabled=False)  # as xdist's own, without --debug

IDS = ["tests/ray/test_a.py::test_1", "tests/ray/test_a.py::test_2", "tests/ray/test_b.py::test_1",
       "tests/plan/test_x.py::test_1", "tests/plan/test_x.py::test_2[p]", "tests/ray/sub/test_c.py::C::test_1",
       "tests/test_y.py::C::test_1", "tests/test_y.py::test_2", "tests/rayish/test_z.py::test_1"]


class Worker:
    """What the scheduler needs of xdist's WorkerController: it is sent indices into its collection."""

    def __init__(self, name: str):
        self.name, self.sent, self.shutting_down = name, [], False
        self.gateway = SimpleNamespace(id=name)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def run(sched, workers: list[Worker]) -> dict[str, list[str]]:
    """Schedule IDS on the workers and run everything they are sent: test id lists per worker, in run order."""
    for w in workers:
        sched.add_node(w)
    for w in workers:
        sched.add_node_collection(w, IDS)
    sched.schedule()
    ran: dict[str, list[str]] = {w.name: [] for w in workers}
    while any(w.sent for w in workers):
        for w in workers:
            if w.sent:
                i = w.sent.pop(0)
                ran[w.name].append(IDS[i])
                sched.mark_test_complete(w, i)  # may send this worker more
    assert sched.tests_finished
    return ran


def test_loadfile_keeps_a_file_and_a_one_worker_folder_on_one_worker(pytester):
    assert "tests/ray/" in ONE_WORKER_FOLDERS
    sched = pytest_xdist_make_scheduler(pytester.parseconfig("--tx", "2*popen", "--dist", "loadfile"), QUIET)
    assert sched is not None
    scope = sched._split_scope
    assert {scope(i) for i in IDS[:3]} | {scope(IDS[5])} == {"tests/ray/"}  # nested folders too
    assert scope(IDS[3]) == scope(IDS[4]) == "tests/plan/test_x.py" and scope(IDS[6]) == "tests/test_y.py"
    assert scope(IDS[8]) == "tests/rayish/test_z.py"  # a prefix of the name is not the folder
    ran = run(sched, [Worker("w1"), Worker("w2")])
    assert sorted(i for ids in ran.values() for i in ids) == sorted(IDS)  # each test once
    # one worker ran each unit: without the hook xdist hands the folder's first two files to the two workers
    for unit in ("tests/ray/", "tests/plan/test_x.py", "tests/test_y.py"):
        on = [w for w, ids in ran.items() if any(i.startswith(unit) for i in ids)]
        assert len(on) == 1, (unit, ran)


@pytest.mark.parametrize("dist", ["load", "loadscope", "worksteal"])
def test_other_dist_modes_keep_xdist_s_scheduler(pytester, dist):
    assert pytest_xdist_make_scheduler(pytester.parseconfig("--tx", "2*popen", "--dist", dist), QUIET) is None
