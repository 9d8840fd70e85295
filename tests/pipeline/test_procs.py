"""Role processes: own process groups, logs, failure detection, and no orphans after stop_all (real processes)."""

from __future__ import annotations

import os
import sys
import time

from inflight.pipeline.procs import ProcessGroup


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); count it as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _grandchild_script(pid_file: str) -> str:
    # a role that starts a helper of its own (like a reward worker pool) and then sleeps
    return (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({pid_file!r}, 'w').write(str(p.pid))\n"
        "print('role up', flush=True)\n"
        "time.sleep(600)\n"
    )


def sleeper(seconds: float) -> None:  # spawn target (module level, picklable)
    print("function role up", flush=True)
    time.sleep(seconds)


def crasher() -> None:
    print("about to fail", flush=True)
    raise RuntimeError("boom in the role")


def test_stop_all_kills_children_and_grandchildren(tmp_path):
    procs = ProcessGroup(tmp_path / "logs")
    pid_file = tmp_path / "grandchild.pid"
    cmd = procs.start_command("server0", [sys.executable, "-c", _grandchild_script(str(pid_file))])
    fn = procs.start_function("trainer", sleeper, (600,))
    deadline = time.time() + 30
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.05)
    while not pid_file.read_text().strip():
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert _alive(cmd.pid) and _alive(fn.pid) and _alive(grandchild)
    assert os.getpgid(cmd.pid) == cmd.pid  # each role leads its own group
    assert procs.first_exited() is None
    procs.stop_all(grace_s=5)
    for pid in (cmd.pid, fn.pid, grandchild):
        deadline = time.time() + 5
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"process {pid} survived stop_all"
    assert "role up" in (tmp_path / "logs" / "server0.log").read_text()


def test_failed_function_role_is_detected_with_its_log(tmp_path):
    procs = ProcessGroup(tmp_path / "logs")
    procs.start_function("actor", crasher)
    ok = procs.start_function("trainer", sleeper, (600,))
    deadline = time.time() + 30
    failed = None
    while failed is None and time.time() < deadline:
        failed = procs.first_exited()
        time.sleep(0.05)
    try:
        assert failed is not None and failed.name == "actor"
        assert failed.poll() == 1
        tail = failed.tail(5)
        assert "boom in the role" in tail and "RuntimeError" in tail
        assert ok.poll() is None
    finally:
        procs.stop_all(grace_s=5)
    assert ok.poll() is not None


def test_children_die_with_the_launcher(tmp_path):
    """SIGKILL the launcher itself: the kernel's parent-death signal takes its roles down (no orphans)."""
    import subprocess

    pid_file = tmp_path / "role.pid"
    launcher = (
        "import sys, time\n"
        "from inflight.pipeline.procs import ProcessGroup\n"
        f"procs = ProcessGroup({str(tmp_path / 'logs')!r})\n"
        "c = procs.start_command('server0', [sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", launcher])
    deadline = time.time() + 30
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.05)
    while not pid_file.read_text().strip():
        time.sleep(0.05)
    role = int(pid_file.read_text())
    assert _alive(role)
    p.kill()
    p.wait()
    deadline = time.time() + 10
    while _alive(role) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(role)
