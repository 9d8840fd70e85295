"""The process's SIGINT/SIGTERM handlers kept across code that replaces them (verifiers' Environment installs its
own when built): the pytest process keeps its Ctrl-C and SIGTERM behaviour after a test builds an environment."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def handlers() -> dict[signal.Signals, object]:
    return {s: signal.getsignal(s) for s in SIGNALS}


@contextmanager
def kept_signal_handlers() -> Iterator[None]:
    saved = handlers()
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
