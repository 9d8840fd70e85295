"""A small pool of worker processes where one call can be killed: the worker that runs past its timeout (or dies)
is SIGKILLed and replaced, the others keep going. (concurrent.futures' ProcessPoolExecutor cannot cancel a task
that has started, and a crashed worker breaks the whole pool.)

Each worker builds its function once with `factory(*factory_args)` (a top-level, importable function) and then
answers calls `fn(*args)` one at a time over its own pipe. The pipe carries multiprocessing's usual pickles, between
this process and the children it started, never from a network.

`call` is blocking and thread-safe; with at most `size` threads calling at once every call finds an idle worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import signal
import time
from typing import Any, Callable, Literal

from inflight.process import die_with_parent

log = logging.getLogger("inflight.rewards")

Outcome = Literal["ok", "raised", "timeout", "crashed"]


def _worker_main(conn: Any, factory: Callable[..., Callable[..., Any]], factory_args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    die_with_parent(signal.SIGKILL)
    try:
        fn = factory(*factory_args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        if args is None:
            return
        try:
            conn.send(("ok", fn(*args)))
        except Exception as exc:  # noqa: BLE001 - the caller labels it; the worker stays usable
            conn.send(("raised", f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, ctx: Any, factory: Callable, factory_args: tuple):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, factory, factory_args), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            self.kill()
            raise RuntimeError(f"reward worker did not start within {timeout_s:.0f} s")
        try:
            kind, msg = self.conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(f"reward worker died while starting (exit code {self.proc.exitcode})") from None
        if kind != "ready":
            self.kill()
            raise RuntimeError(f"reward worker failed to start: {msg}")
        self.ready = True

    def call(self, args: tuple, timeout_s: float) -> tuple[Outcome, Any]:
        try:
            self.conn.send(args)
            if not self.conn.poll(timeout_s):
                return "timeout", f"no answer within {timeout_s:g} s"
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.proc.join(1.0)
            return "crashed", f"worker died (exit code {self.proc.exitcode})"

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(2.0)
        self.kill()


class KillablePool:
    """`size` processes running `factory(*factory_args)(*args)` with a per-call timeout."""

    def __init__(
        self,
        factory: Callable[..., Callable[..., Any]],
        factory_args: tuple = (),
        size: int = 2,
        start_timeout_s: float = 120.0,
        ctx: Any = None,
    ):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self._ctx = ctx or mp.get_context("spawn")
        self._factory, self._factory_args = factory, factory_args
        self.size, self.start_timeout_s = size, start_timeout_s
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self.replaced = 0  # workers killed (timeout) or found dead, and started again
        workers = [_Worker(self._ctx, factory, factory_args) for _ in range(size)]  # start all, then wait
        try:
            for w in workers:
                w.wait_ready(start_timeout_s)
        except BaseException:
            for w in workers:
                w.kill()
            raise
        for w in workers:
            self._idle.put(w)
        self._closed = False

    def call(self, args: tuple, timeout_s: float) -> tuple[Outcome, Any]:
        """Run fn(*args) in an idle worker: ("ok", result) | ("raised", message) | ("timeout", message) |
        ("crashed", message). Waits for an idle worker when all are busy."""
        if self._closed:
            raise RuntimeError("pool is closed")
        w = self._idle.get()
        if not w.proc.is_alive():  # died while idle (killed from outside): not this call's fault
            w.kill()
            w = _Worker(self._ctx, self._factory, self._factory_args)
            self.replaced += 1
        try:
            w.wait_ready(self.start_timeout_s)  # a replacement may still be starting; not part of timeout_s
            outcome, value = w.call(args, timeout_s)
        except RuntimeError as exc:  # a replacement that failed to start: try another next time
            outcome, value = "crashed", str(exc)
        if outcome in ("timeout", "crashed"):
            t0 = time.monotonic()
            w.kill()
            w = _Worker(self._ctx, self._factory, self._factory_args)
            self.replaced += 1
            log.warning("reward worker %s (%s); replaced in %.2f s", outcome, value, time.monotonic() - t0)
        if self._closed:  # closed while this call ran
            w.stop()
        else:
            self._idle.put(w)
        return outcome, value

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().stop()
            except queue.Empty:
                break
