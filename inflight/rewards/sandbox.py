"""Run untrusted work (a reward function that executes model output, e.g. code tasks) in a separate process with
CPU-time, memory and wall-time limits.

    limits = SandboxLimits(cpu_s=2, memory_mb=256, wall_s=5)
    r = run_python("print(int(input()) * 2)", stdin="21", limits=limits)     # r.outcome == "ok", r.stdout == "42\n"
    r = run_function("my_pkg.rewards:score", ["completion text", "gold"], limits=limits)   # r.value: its result

The child is a fresh interpreter (`python -I`: no user site, no PYTHONPATH, no inherited environment beyond a few
variables) started in its own session and in a temporary working directory. Before it runs anything it sets
  RLIMIT_CPU   (cpu_s; the kernel sends SIGXCPU, then SIGKILL one second later)     -> outcome "cpu_limit"
  RLIMIT_AS    (memory_mb of address space; allocations fail with MemoryError)      -> outcome "memory_limit"
  RLIMIT_FSIZE (max_file_mb written), RLIMIT_CORE 0 (no core dumps)
and the parent kills the whole process group after wall_s (sleeping or blocked work)  -> outcome "timeout".
Other outcomes: "ok", "raised" (the code raised; the message says what), "crashed" (died some other way).
Arguments and results cross the process boundary as JSON, never pickle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Literal

Outcome = Literal["ok", "raised", "cpu_limit", "memory_limit", "timeout", "crashed"]


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds (whole seconds: RLIMIT_CPU's unit)
    memory_mb: int = 512  # address space of the child (RLIMIT_AS)
    wall_s: float = 10.0  # real time, including sleeps and start-up
    max_file_mb: int = 16  # largest file the child may write
    max_output_bytes: int = 1 << 20  # stdout / stderr kept


@dataclass
class SandboxResult:
    outcome: Outcome
    value: Any = None  # run_function: the function's return value (JSON)
    stdout: str = ""
    stderr: str = ""
    message: str = ""  # why, for every outcome but "ok"
    returncode: int | None = None


# The child's first code: set the limits, then run the job. Passed with -c, so no file of ours is imported before
# the limits apply. Job on stdin (JSON): {"kind": "code", "code": ..., "stdin": ...} or {"kind": "function", ...}.
_BOOT = r"""
import json, resource, sys
job = json.loads(sys.stdin.readline())
lim = job["limits"]
resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] << 20, lim["memory_mb"] << 20))
resource.setrlimit(resource.RLIMIT_FSIZE, (lim["max_file_mb"] << 20, lim["max_file_mb"] << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
def report(kind, value):
    sys.__stderr__.write("\n@@SANDBOX@@" + json.dumps({"kind": kind, "value": value}) + "\n")
    sys.__stderr__.flush()
try:
    if job["kind"] == "code":
        import io
        sys.stdin = io.StringIO(job["stdin"])
        exec(compile(job["code"], "<sandboxed>", "exec"), {"__name__": "__main__"})
        report("ok", None)
    else:
        import importlib
        sys.path[:0] = job["path"]
        module, _, name = job["target"].partition(":")
        fn = getattr(importlib.import_module(module), name)
        report("ok", fn(*job["args"]))
except MemoryError:
    report("memory", "MemoryError")
except SystemExit as e:
    report("ok" if e.code in (None, 0) else "raised", f"SystemExit({e.code!r})")
except BaseException as e:
    report("raised", f"{type(e).__name__}: {e}")
"""

_MARK = "\n@@SANDBOX@@"


def _set_child_env() -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(job: dict[str, Any], limits: SandboxLimits) -> SandboxResult:
    job = {**job, "limits": {"cpu_s": int(max(1, limits.cpu_s)), "memory_mb": int(limits.memory_mb),
                             "max_file_mb": int(limits.max_file_mb)}}
    with tempfile.TemporaryDirectory(prefix="inflight-sandbox-") as tmp:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=tmp, env=_set_child_env(),
                                start_new_session=True)  # own process group: the wall-time kill gets its children
        try:
            out, err = proc.communicate((json.dumps(job) + "\n").encode(), timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
    cap = limits.max_output_bytes
    out_s, err_s = out.decode("utf-8", "replace")[:cap], err.decode("utf-8", "replace")
    report = None
    if _MARK in err_s:
        err_s, _, tail = err_s.rpartition(_MARK)
        try:
            report = json.loads(tail.strip().splitlines()[0])
        except (ValueError, IndexError):
            report = None
    res = SandboxResult("crashed", stdout=out_s, stderr=err_s[-cap:], returncode=proc.returncode)
    rc = proc.returncode
    if timed_out:
        res.outcome, res.message = "timeout", f"wall-time limit of {limits.wall_s:g} s reached; process killed"
    elif rc in (-signal.SIGXCPU, -signal.SIGKILL) and report is None:
        res.outcome, res.message = "cpu_limit", f"CPU-time limit of {limits.cpu_s} s reached (signal {-rc})"
    elif (report or {}).get("kind") == "memory" or (report is None and "MemoryError" in err_s[-2000:]):
        res.outcome, res.message = "memory_limit", f"memory limit of {limits.memory_mb} MB reached (MemoryError)"
    elif report is None:
        res.message = f"child died without a result (exit code {rc}): {err_s[-500:]}"
    elif report["kind"] == "ok":
        res.outcome, res.value = "ok", report["value"]
    else:
        res.outcome, res.message = "raised", str(report["value"])
    return res


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Execute Python source (model output) with `stdin` as its standard input; stdout is in the result."""
    return _run({"kind": "code", "code": code, "stdin": stdin}, limits)


def run_function(target: str, args: list[Any], limits: SandboxLimits = SandboxLimits(),
                 sys_path: list[str] | None = None) -> SandboxResult:
    """Call `package.module:function(*args)` in the sandbox; args and the return value must be JSON values.
    `sys_path`: folders to import from besides the installed packages (the child ignores PYTHONPATH)."""
    json.dumps(args)  # fail here, in the caller, on arguments that cannot cross
    return _run({"kind": "function", "target": target, "args": list(args), "path": list(sys_path or [])}, limits)
