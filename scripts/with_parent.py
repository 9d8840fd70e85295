"""Run a command that ends when the process that started this one ends:

    python scripts/with_parent.py python -m inflight.cli serve --model DIR ...

The GPU bench starts its servers through it (bench_engine.start_server): a server runs in a session of its own (it
is stopped as a process group), so a stage killed at its cap, even while the server is still starting and before
the stage could record its process group, would leave it holding the GPU. A parent-death signal does not do here:
the kernel sends it when the *thread* that started the child ends, and the push stage starts its server from a
helper thread. This process stays the group's leader, polls its parent, and on the parent's death stops the group
(SIGTERM, then SIGKILL). A SIGTERM to the group (ServerProcess.stop) reaches the command directly; this process then
waits for it and exits with its code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

POLL_S = 0.5
GRACE_S = 10.0


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: with_parent.py COMMAND [ARG ...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the command: wait for it to end
    proc = subprocess.Popen(argv, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:  # orphaned: the stage is gone
            break
    os.killpg(0, signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(0, signal.SIGKILL)  # this process too
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
