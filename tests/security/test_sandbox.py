"""inflight.rewards.sandbox: untrusted code runs in a child with CPU, memory and wall-time limits. Each test tries
to exceed one limit and checks that the child was stopped with that limit's label (and well before it could have
finished on its own)."""

from __future__ import annotations

import time

from inflight.rewards.sandbox import SandboxLimits, run_function, run_python

# Generous wall time where the wall limit is not under test: the machine is shared, CPU seconds come slowly.
CPU_TEST = SandboxLimits(cpu_s=1, memory_mb=256, wall_s=120)


def test_ok_program_reads_stdin_and_writes_stdout():
    r = run_python("n = int(input())\nprint(sum(range(n)))", stdin="101", limits=CPU_TEST)
    assert (r.outcome, r.stdout) == ("ok", "5050\n"), r


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", limits=CPU_TEST)
    assert r.outcome == "cpu_limit", r
    assert "CPU-time limit of 1 s" in r.message
    assert time.monotonic() - t0 < 100  # stopped by the kernel, not by the 120 s wall clock


def test_cpu_limit_holds_even_if_the_code_ignores_sigxcpu():
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    r = run_python(code, limits=CPU_TEST)
    assert r.outcome == "cpu_limit", r  # the hard limit (soft + 1 s) kills it


def test_big_allocation_is_stopped_by_the_memory_limit():
    r = run_python("x = bytearray(2 << 30)\nprint('allocated')", limits=SandboxLimits(memory_mb=256, wall_s=60))
    assert r.outcome == "memory_limit", r
    assert "256 MB" in r.message and "allocated" not in r.stdout
    # the same program fits when the limit allows it: the label is caused by the limit, not by the program
    small = run_python("x = bytearray(16 << 20)\nprint('allocated')", limits=SandboxLimits(memory_mb=256, wall_s=60))
    assert (small.outcome, small.stdout) == ("ok", "allocated\n"), small


def test_sleep_is_stopped_by_the_wall_time_limit():
    t0 = time.monotonic()
    r = run_python("import time\ntime.sleep(60)\nprint('woke up')", limits=SandboxLimits(cpu_s=5, wall_s=2))
    elapsed = time.monotonic() - t0
    assert r.outcome == "timeout" and "woke up" not in r.stdout, r
    assert elapsed < 30  # far less than the 60 s sleep


def test_wall_time_kill_reaches_grandchildren():
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(p.pid, flush=True)\np.wait()")
    t0 = time.monotonic()
    r = run_python(code, limits=SandboxLimits(cpu_s=5, wall_s=3))
    assert r.outcome == "timeout", r
    assert time.monotonic() - t0 < 60  # a surviving grandchild would hold the output pipe open for 120 s
    pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + 10
    import os

    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break  # the sleeping grandchild died with the process group
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    break  # a zombie: dead, waiting for init to reap it
        except FileNotFoundError:
            break
        assert time.monotonic() < deadline, "grandchild survived the wall-time kill"
        time.sleep(0.1)


def test_exceptions_and_crashes_are_labelled():
    r = run_python("raise KeyError('boom')", limits=CPU_TEST)
    assert r.outcome == "raised" and "KeyError" in r.message and "boom" in r.message
    r = run_python("import os\nos._exit(3)", limits=CPU_TEST)
    assert r.outcome == "crashed" and r.returncode == 3


def test_child_sees_no_parent_environment(monkeypatch):
    monkeypatch.setenv("INFLIGHT_SECRET_TOKEN", "hunter2")
    r = run_python("import os\nprint(os.environ.get('INFLIGHT_SECRET_TOKEN'))", limits=CPU_TEST)
    assert r.stdout == "None\n", r


def test_run_function_returns_json_value(tmp_path):
    (tmp_path / "score_mod.py").write_text("def score(text, gold):\n    return {'reward': float(text == gold)}\n")
    r = run_function("score_mod:score", ["42", "42"], limits=CPU_TEST, sys_path=[str(tmp_path)])
    assert (r.outcome, r.value) == ("ok", {"reward": 1.0}), r
    (tmp_path / "hog_mod.py").write_text("def hog(n):\n    return len(bytearray(n))\n")
    r = run_function("hog_mod:hog", [2 << 30], limits=SandboxLimits(memory_mb=256, wall_s=60), sys_path=[str(tmp_path)])
    assert r.outcome == "memory_limit", r
