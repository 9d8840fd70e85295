"""Small helpers about this host that every role may use: a free TCP port, and a child that dies with its parent."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except OSError:
            pass
