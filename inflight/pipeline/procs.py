"""Child processes of the launcher: each role in its own session (process group), its output in a log file, and
a parent-death signal so that nothing outlives the launcher even if the launcher is SIGKILLed.

Two kinds of children with one interface: commands (`subprocess.Popen`, e.g. `inflight serve`) and Python
functions (`multiprocessing` "spawn", e.g. the trainer loop, so that in-memory stream handles can be passed).
Stopping a child kills its whole process group, which takes the role's own helpers (reward worker pool, FSDP
ranks, ...) with it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from inflight.process import die_with_parent


def _preexec() -> None:  # runs in the forked child before exec
    os.setsid()
    die_with_parent()


def _spawn_entry(fn: Callable[..., Any], args: tuple, log_path: str, parent_pid: int) -> None:
    """Start of a Python-function child: own session, output to the log file, then the role."""
    os.setsid()
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run finally-blocks / atexit on a polite stop
    fn(*args)


@dataclass
class Child:
    name: str
    log_path: Path
    popen: subprocess.Popen | None = None
    process: Any = None  # multiprocessing.Process
    started: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else self.process.pid

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        if self.popen is not None:
            return self.popen.poll()
        return None if self.process.is_alive() else self.process.exitcode

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # pgid == pid: every child is a session leader
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.pid, sig)  # not yet a group leader (a spawn child before setsid)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.poll() is not None:
                return True
            time.sleep(0.05)
        return self.poll() is not None

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=n))
        except FileNotFoundError:
            return "(no log)"


class ProcessGroup:
    """The set of role processes of one run."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []

    def start_command(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, preexec_fn=_preexec)
        child = Child(name, log_path, popen=popen)
        self.children.append(child)
        return child

    def start_function(self, name: str, fn: Callable[..., Any], args: tuple = (),
                       env: dict[str, str] | None = None) -> Child:
        log_path = self.log_dir / f"{name}.log"
        ctx = mp.get_context("spawn")
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})  # spawn copies the parent's environment at start
        try:
            process = ctx.Process(target=_spawn_entry, args=(fn, args, str(log_path), os.getpid()), name=name,
                                  daemon=False)
            process.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child = Child(name, log_path, process=process)
        self.children.append(child)
        return child

    def first_exited(self) -> Child | None:
        for child in self.children:
            if child.poll() is not None:
                return child
        return None

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every group, wait up to grace_s, then SIGKILL what is left (groups included)."""
        for child in self.children:
            child.signal_group(signal.SIGTERM)
        deadline = time.time() + grace_s
        for child in self.children:
            child.wait(max(0.0, deadline - time.time()))
        for child in self.children:
            if child.poll() is None or child.group_alive():
                child.signal_group(signal.SIGKILL)
        for child in self.children:
            child.wait(5.0)
            if child.popen is not None:
                child.popen.wait(timeout=5)
            else:
                child.process.join(timeout=5)
