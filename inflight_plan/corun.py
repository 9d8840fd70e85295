"""How much the trainer and a server slow each other when both compute at once on one machine's cores, measured.

contention.py's processor sharing only slows roles down when they want more threads than there are cores. Two
compute-bound roles on two separate cores still slow each other: they share the last-level cache and the memory
bandwidth (on the 2-core CPU here, six measurements: the trainer 1.00-1.23x slower beside a decoding server, the
server 1.08-1.35x slower beside the trainer; 2026-12-03). That factor depends on the machine and the models, so it is
measured, not guessed:

- trainer: forward + backward + optimizer seconds of the same packed batch, alone and while a real `inflight serve`
  decodes a full batch (HTTP requests with ignore_eos kept in flight by a load thread);
- server: the seconds of a decode burst (b sequences x n tokens, less the same burst's prefill-only time), alone and
  while the trainer trains in a thread of this process.

Each factor is slowed / alone (>= 1 by construction of the model: a ratio under 1 is noise and is kept at 1).

The push slows down too, and more: its threads (the trainer's, the server's receiving one) hand work to each other
and each hand-off waits for a core or an interpreter. measure_push_beside times it alone, while the trainer trains,
while the server decodes, and while both do, as in a pipelined run (demo model here: 8 ms alone, +2.5-3.9 ms
beside training, +2.7-3.9 beside decoding, +8.2-9.0 beside both: on 2 cores, more than the sum).
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable

import httpx

from inflight.config import RunConfig
from inflight.engine.serve import ServerProcess
from inflight_plan.measure import push_session
from inflight_plan.reply import schedstat_fields


class _Toggled(threading.Thread):
    """Runs `work()` over and over while `on` is set; `idle` is set whenever no call is in progress."""

    def __init__(self, work: Callable[[], object], name: str):
        super().__init__(name=name, daemon=True)
        self.work, self.on, self.idle, self.stop = work, threading.Event(), threading.Event(), threading.Event()
        self.idle.set()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.on.wait(0.01):
                continue
            self.idle.clear()
            try:
                if self.on.is_set():  # again, now that `idle` is clear: set(False) may have returned in between
                    self.work()
            finally:
                self.idle.set()

    def set(self, on: bool) -> None:
        if on:
            self.on.set()
            time.sleep(0.2)  # under way (a decode load: past its prefill)
        else:
            self.on.clear()
            self.idle.wait()

    def close(self) -> None:
        self.stop.set()
        self.on.set()
        self.join()


def _fresh_prompt() -> list[int]:
    """16 token ids (valid in any vocabulary), new each request: a server's prefix cache must not skip the prefill."""
    return [5 + random.randrange(90) for _ in range(16)]


def _burst(url: str, model: str, batch: int, tokens: int) -> float:
    """Seconds for one request of `batch` completions of `tokens` new tokens (ignore_eos)."""
    t0 = time.perf_counter()
    httpx.post(url + "/v1/completions", json={"model": model, "prompt": _fresh_prompt(), "max_tokens": tokens,
                                              "ignore_eos": True, "n": batch, "temperature": 1.0},
               timeout=600.0).raise_for_status()
    return time.perf_counter() - t0


def _decode_s(url: str, model: str, batch: int, tokens: int, repeats: int) -> float:
    """Median seconds of the decode steps alone: a burst of `tokens` minus one of 1 token (prefill, HTTP)."""
    return statistics.median(_burst(url, model, batch, tokens) - _burst(url, model, batch, 1)
                             for _ in range(repeats))


def measure_interference(cfg: RunConfig, train_step: Callable[[], float], batch: int, tokens: int = 64,
                         rounds: int = 4, per_round: int = 3) -> tuple[float, float]:
    """(trainer factor, server factor): slowed / alone, medians over `rounds` alternations of the other role off and
    on (`per_round` timings each), so that a drift of the machine's load hits both alike. `cfg`: RunConfig (model,
    server threads); `train_step()` runs one trainer step and returns its seconds."""
    args = ["--threads", str(cfg.server.threads), "--max-model-len", str(cfg.server.max_model_len),
            "--max-batch", str(max(batch, 1))]
    with ServerProcess(cfg.model.path, extra_args=args) as server:
        url = server.url
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        _burst(url, model, 2, 4)  # warm-up
        train_step()
        decoding = _Toggled(lambda: _burst(url, model, batch, tokens), "decode-load")
        training = _Toggled(train_step, "train-load")
        decoding.start()
        training.start()
        t_alone: list[float] = []
        t_slowed: list[float] = []
        s_alone: list[float] = []
        s_slowed: list[float] = []
        try:
            for _ in range(rounds):
                for on, out in ((False, t_alone), (True, t_slowed)):
                    decoding.set(on)
                    out += [train_step() for _ in range(per_round)]
                decoding.set(False)
                for on, out in ((False, s_alone), (True, s_slowed)):
                    training.set(on)
                    out += [_decode_s(url, model, batch, tokens, 1) for _ in range(per_round)]
                training.set(False)
        finally:
            decoding.close()
            training.close()
    med = statistics.median
    return max(1.0, med(t_slowed) / med(t_alone)), max(1.0, med(s_slowed) / med(s_alone))


def measure_push_beside(cfg: RunConfig, train_step: Callable[[], float], batch: int, tokens: int = 64, rounds: int = 4,
                        per_round: int = 5) -> dict[str, float]:
    """What a push (measure.push_session) takes more while this process trains (a pipelined trainer pushes from a
    thread while its loop trains the next step: the two share its interpreter and the cores), while the server
    decodes a full batch (its receiving thread shares the engine's interpreter), and while both do. Where the server
    decodes, the update also waits for a step boundary, which the simulator adds itself: half a step at that batch
    is taken off. Medians over `rounds` alternations of the four, `per_round` pushes each; an extra under 0 is noise
    and kept at 0. Returns Profile.push_beside_train_s, push_beside_decode_s and push_beside_both_s."""
    with push_session(cfg, ("--max-batch", str(max(batch, 1)))) as (url, push):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        boundary = _decode_s(url, model, batch, tokens, 1) / tokens / 2  # half a decode step at this batch
        decoding = _Toggled(lambda: _burst(url, model, batch, tokens), "decode-load")
        training = _Toggled(train_step, "train-load")
        decoding.start()
        training.start()
        times: dict[tuple[bool, bool], list[float]] = {}
        try:
            for _ in range(rounds):
                for dec, train in ((False, False), (False, True), (True, False), (True, True)):
                    decoding.set(dec)
                    training.set(train)
                    for _ in range(per_round):
                        times.setdefault((dec, train), []).append(push()[0])
                        time.sleep(0.02)
        finally:
            decoding.close()
            training.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    alone = med[False, False]
    return {"push_beside_train_s": max(0.0, med[False, True] - alone),
            "push_beside_decode_s": max(0.0, med[True, False] - alone - boundary),
            "push_beside_both_s": max(0.0, med[True, True] - alone - boundary)}


def measure_wakeup_wait(cores: int = 0, seconds: float = 1.5) -> float:
    """Seconds a thread that wakes up waits for a core while every core is taken: the calling thread, which
    sleeps 1 ms and computes 0.2 ms, over and over, beside `cores` (default: this process's cores) busy processes;
    its wait for a core per time it was put on one (/proc/self/task/<tid>/schedstat). The actor wakes up a few
    times per group it handles (a reply, its reward, the stream put): on shared cores each wake-up waits this."""
    cores = cores or len(os.sched_getaffinity(0))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    me = os.getpid(), threading.get_native_id()
    try:
        time.sleep(0.3)  # the busy processes under way
        a = schedstat_fields(*me)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            time.sleep(0.001)
            spin = time.perf_counter() + 0.0002
            while time.perf_counter() < spin:
                pass
        b = schedstat_fields(*me)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return (b[1] - a[1]) / max(1, b[2] - a[2])
