"""Per-group reply work (`inflight profile`): what a group costs outside decoding, timed on the real code paths.

On a GPU cluster this is noise; on a few shared CPU cores it is a tenth of a step or more: the real loop spends
milliseconds per group turning finished sequences into a JSON reply, parsing it, scoring it and streaming it.

    server   a real `inflight serve` (the launcher's own command line for the config) answers groups of the
             config's group size, every completion exactly L tokens (ignore_eos): the CPU time of its main
             thread, the event loop that parses the request, detokenises, builds the logprob lists and encodes the
             JSON while the engine thread decodes (it shares the interpreter: the engine waits meanwhile);
    actor    the real actor (open_actor: the config's task, reward service and server pool, a MemoryStream)
             generating rounds of those groups: the CPU time of this process (event loop, HTTP client, reply
             parsing, samples, msgpack and the stream put) plus its reward workers';
    trainer  reading the groups back (stream get + decode), the trainer's side of the stream.

The server's share that is spent when a group's requests arrive (HTTP, parsing, the chat prompt, submission) is
timed apart: requests held at the server's version gate, so that nothing decodes or replies meanwhile. It falls on
the server at the arrival, not at the end: a sync round's requests come in one burst, right when the weights do.

That HTTP work runs on the server's main thread while the engine thread decodes; the two share the interpreter
lock, and how much decoding the HTTP work costs is measured too (_stall): a fixed decode (a batch of the config's
lengths, ignore_eos) timed alone and with a burst of held requests parsed meanwhile, the engine thread pinned to a
core of its own and its waits for that core (other processes on a busy machine) taken out, so that only the lock
(not a shared core) can slow it: seconds lost / seconds of HTTP work; and the engine thread's own CPU meanwhile
(handing the lock back and forth: it still wants a core for that share).

CPU time, not wall time (Linux: /proc/<pid>/task/<tid>/schedstat, nanoseconds): the decoding itself runs on the
engine thread and is in the decode curve already. The same file counts how many times the actor's loop and the
server's main thread were put on a CPU during the rounds: their wake-ups per group, each of which waits for a core
where the roles share cores that are all taken (corun.measure_wakeup_wait). Each role is timed at two lengths
L1 < L2 and written as seconds per group + seconds per completion token (a line through the two points, each
cost >= 0).
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import multiprocessing as mp
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from inflight.actor.run import make_rewards, open_actor
from inflight.config import RunConfig
from inflight.config.actor import ActorConfig
from inflight.engine.serve import ServerProcess
from inflight.pipeline.launch_common import server_command, thread_env
from inflight.process import free_port
from inflight.streams.memory import MemoryStream


def thread_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds of one thread (tid) or of every thread of a process, from /proc (0.0 when it has exited)."""
    return schedstat_s(pid, tid)[0]


def schedstat_s(pid: int, tid: int | None = None) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of one thread (tid) or of every thread of a process,
    from /proc/<pid>/task/<tid>/schedstat ((0.0, 0.0) when it has exited)."""
    return schedstat_fields(pid, tid)[:2]


def schedstat_fields(pid: int, tid: int | None = None) -> tuple[float, float, int]:
    """schedstat_s and the times put on a CPU (each wake-up, each preemption ended)."""
    tasks = [str(tid)] if tid is not None else _listdir(f"/proc/{pid}/task")
    cpu = wait = runs = 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                fields = f.read().split()
            cpu, wait, runs = cpu + int(fields[0]), wait + int(fields[1]), runs + int(fields[2])
        except (OSError, ValueError, IndexError):
            continue
    return cpu / 1e9, wait / 1e9, runs


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid` (the reward service's workers)."""
    out = []
    for name in _listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after the command name in parentheses
            out.append(int(name))
    return out


@dataclass
class ReplyCost:
    """CPU seconds per group at one completion length (every completion of the group `length` tokens)."""

    length: int
    group_size: int
    groups: int
    server_s: float  # the server's main thread
    actor_s: float  # the actor's process
    reward_s: float  # the reward workers (counted with the actor)
    trainer_s: float  # stream get + decode
    wall_s: float  # the round, for the record
    actor_wakeups: float = 0.0  # times the actor's event loop was put on a CPU, per group (it waits for one each time)
    server_wakeups: float = 0.0  # the same of the server's main thread (its requests and reply)

    @property
    def tokens(self) -> int:
        return self.length * self.group_size


def line(a: ReplyCost, b: ReplyCost, pick: str) -> tuple[float, float]:
    """(seconds per group, seconds per completion token) through the two points, both >= 0."""
    ya, yb = getattr(a, pick), getattr(b, pick)
    per_token = max(0.0, (yb - ya) / (b.tokens - a.tokens)) if b.tokens != a.tokens else 0.0
    per_group = max(0.0, ya - per_token * a.tokens)
    if per_group == 0.0 and a.tokens:  # the line would cross below zero: keep it through the first point
        per_token = ya / a.tokens
    return per_group, per_token


def fixed_length_rollout(length: int) -> Any:
    """The default rollout (actor/rollout.py), every completion exactly `length` tokens."""
    async def rollout(ts: Any, client: Any, cfg: ActorConfig) -> list:
        kw = {"max_tokens": length, "ignore_eos": True}
        if cfg.use_n:
            completions = await client.chat(ts.messages, n=cfg.group_size, **kw)
        else:
            parts = await asyncio.gather(*(client.chat(ts.messages, n=1, **kw) for _ in range(cfg.group_size)))
            completions = [c for p in parts for c in p]
        return [client.to_sample(ts, c) for c in completions]

    return rollout


PARKED = 2 ** 40  # a weight version no server reaches: a request asking for it is parsed, then held


async def _request_cost(actor: Any, server_pid: int, groups: int, length: int) -> float:
    """The server main thread's CPU seconds per group while the group's requests arrive: the actor's own requests
    (RolloutClient, as a rollout sends them), held by the server's version gate (PARKED) so that nothing decodes or
    replies meanwhile; they end in 409 when the server's version wait runs out."""
    cfg = actor.cfg
    prompts = [next(actor.prompts) for _ in range(groups)]

    async def group(ts: Any) -> None:
        n = cfg.group_size if cfg.use_n else 1
        await asyncio.gather(*(actor.client.chat(ts.messages, n=n, max_tokens=length, min_weight_version=PARKED)
                               for _ in range(cfg.group_size // n)), return_exceptions=True)

    s0 = thread_cpu_s(server_pid, server_pid)
    tasks = [asyncio.create_task(group(ts)) for ts in prompts]
    await asyncio.sleep(0.2 + 0.005 * groups)  # every request parsed and held (a few ms each)
    s1 = thread_cpu_s(server_pid, server_pid)
    await asyncio.gather(*tasks)
    return (s1 - s0) / groups


def _threads(pid: int) -> list[int]:
    return [int(t) for t in _listdir(f"/proc/{pid}/task")]


def _held_request(url: str, model: str, messages: list, api_key: str | None) -> bytes:
    """The bytes of one chat request held at the version gate (PARKED), ready to write to a socket."""
    body = json.dumps({"model": model, "messages": messages, "n": 1, "max_tokens": 1,
                       "min_weight_version": PARKED}).encode()
    host = urlsplit(url).netloc
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _stall(actor: Any, url: str, api_key: str | None, server_pid: int, request_s: float,
                 batch: int) -> tuple[float, float] | None:
    """(seconds of decoding the server's engine thread loses, seconds it computes meanwhile) per second of its main
    thread's HTTP work (None: fewer than 2 cores to keep them apart). `request_s`: main-thread seconds per held
    request (_request_cost); `batch`: the decode's sequences. The held requests go out as bytes prepared beforehand
    on connections opened beforehand, so that this process (on the main thread's core) costs next to nothing while
    they are parsed. The server is left pinned: it is measured last."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or request_s <= 0:
        return None
    cfg, client = actor.cfg, actor.client
    messages = next(actor.prompts).messages
    where = urlsplit(url)

    async def decode() -> None:
        await client.chat(messages, n=batch, max_tokens=cfg.max_new_tokens, ignore_eos=True)

    async def send(socks: list[socket.socket], gap_s: float) -> None:
        """One held request per socket, spread over the decode's first 60%: the main thread parses each as it
        comes, so the decode's own reply never waits behind them."""
        for sock in socks:
            sock.sendall(request)
            await asyncio.sleep(gap_s)

    # the engine thread: the server's busiest thread other than the main one over a decode
    before = {t: thread_cpu_s(server_pid, t) for t in _threads(server_pid)}
    await decode()
    request = _held_request(url, client.model, messages, api_key)
    engine = max((t for t in before if t != server_pid),
                 key=lambda t: thread_cpu_s(server_pid, t) - before[t])
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(engine, {cores[0]})
        for t in _threads(server_pid):
            if t != engine:
                os.sched_setaffinity(t, set(cores[1:]))
        os.sched_setaffinity(0, set(cores[1:]))
        alone = math.inf
        for _ in range(3):  # the best of 3: one slow decode on a busy machine would spread the sends past the decode
            t0 = time.perf_counter()
            await decode()
            alone = min(alone, time.perf_counter() - t0)
        burst = max(1, int(0.3 * alone / request_s))  # parsed well within the decode
        rounds = min(8, max(4, math.ceil(1.0 / alone)))  # short decodes: more rounds (each waits 1 s for the 409s)
        walls: dict[bool, list[float]] = {False: [], True: []}
        http: dict[bool, list[float]] = {False: [], True: []}
        engine_cpu: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for loaded in (False, True):
                socks = [socket.create_connection((where.hostname, where.port)) for _ in range(burst if loaded else 0)]
                await asyncio.sleep(0.05)  # the connections accepted before the clock starts
                h0, t0 = thread_cpu_s(server_pid, server_pid), time.perf_counter()
                e0, q0 = schedstat_s(server_pid, engine)
                sender = asyncio.create_task(send(socks, 0.6 * alone / max(1, len(socks))))
                await decode()
                e1, q1 = schedstat_s(server_pid, engine)
                # less the engine thread's wait for its core: other processes on it (a busy machine), not the lock
                walls[loaded].append(time.perf_counter() - t0 - (q1 - q0))
                http[loaded].append(thread_cpu_s(server_pid, server_pid) - h0)
                engine_cpu[loaded].append(e1 - e0)
                await sender
                if socks:
                    await asyncio.sleep(1.2)  # the held requests end in 409 at the server's version wait (1 s)
                for sock in socks:
                    sock.close()
    finally:
        os.sched_setaffinity(0, mine)

    def gain(x: dict[bool, list[float]]) -> float:  # loaded - alone, medians
        return sorted(x[True])[rounds // 2] - sorted(x[False])[rounds // 2]

    work = gain(http)
    if work <= 0:
        return None
    return max(0.0, gain(walls)) / work, max(0.0, gain(engine_cpu)) / work


async def _rounds(cfg: RunConfig, url: str, server_pid: int, lengths: list[int],
                  groups: int) -> tuple[list[ReplyCost], float, tuple[float, float] | None]:
    me = os.getpid()
    stream = MemoryStream(capacity=4 * groups, ctx=mp.get_context("spawn"))
    rewards = make_rewards(cfg)
    await asyncio.to_thread(rewards.start)
    out = []
    try:
        # one actor for all rounds, as in a run: its connections and the servers' model name stay open
        async with open_actor(cfg, [url], stream, rollout=fixed_length_rollout(lengths[0]), rewards=rewards) as actor:
            for length in [lengths[0], *lengths]:  # the first round warms up (connections, caches, workers)
                actor.rollout = fixed_length_rollout(length)
                workers = [p for p in children_of(me) if p != server_pid]  # reward workers (+ mp's helpers)
                s0, a0, r0, w0 = (thread_cpu_s(server_pid, server_pid), time.process_time(),
                                  sum(thread_cpu_s(p) for p in workers), time.perf_counter())
                runs0 = (schedstat_fields(me, threading.get_native_id())[2],  # the actor's loop: this thread
                         schedstat_fields(server_pid, server_pid)[2])
                await actor.generate_round(groups)
                runs = (schedstat_fields(me, threading.get_native_id())[2] - runs0[0],
                        schedstat_fields(server_pid, server_pid)[2] - runs0[1])
                wall = time.perf_counter() - w0
                t0 = time.thread_time()
                got = 0
                while got < groups:
                    batch = stream.get(groups - got, timeout_s=30.0)
                    if not batch:
                        raise RuntimeError(f"the stream gave {got} of {groups} groups in 30 s")
                    got += len(batch)
                trainer = time.thread_time() - t0
                s1, a1, r1 = (thread_cpu_s(server_pid, server_pid), time.process_time(),
                              sum(thread_cpu_s(p) for p in workers))
                out.append(ReplyCost(length, cfg.actor.group_size, groups, (s1 - s0) / groups,
                                     (a1 - a0 - trainer) / groups, (r1 - r0) / groups, trainer / groups, wall,
                                     runs[0] / groups, runs[1] / groups))
            request_s = await _request_cost(actor, server_pid, groups, lengths[0])
            per_request = request_s / (1 if cfg.actor.use_n else cfg.actor.group_size)
            decode_batch = min(cfg.server.max_batch, cfg.actor.group_size * cfg.actor.groups_per_step)
            stall = await _stall(actor, url, cfg.server.api_key or None, server_pid, per_request, decode_batch)
    finally:
        await asyncio.to_thread(rewards.close)
        stream.close()
    return out[1:], request_s, stall


def measure_reply(cfg: RunConfig, lengths: tuple[int, int] | None = None,
                  groups: int = 0) -> tuple[list[ReplyCost], float, tuple[float, float] | None]:
    """Per-group CPU seconds of the server, the actor (+ reward workers) and the trainer's stream read at two
    completion lengths (default max_new_tokens / 4 and max_new_tokens), `groups` groups each (default 2 steps'
    worth); the server's share of it spent when a group's requests arrive (_request_cost); and the decoding its
    HTTP work costs and the engine's CPU meanwhile, per second of it (_stall; None on one core). `cfg`: RunConfig,
    built-in engine (the server's threads are read from /proc)."""
    cfg = copy.deepcopy(cfg)
    a = cfg.actor
    top = a.max_new_tokens
    lengths = lengths or (max(1, top // 4), top)
    groups = groups or 2 * a.groups_per_step
    cfg.actor.eval_every = 0
    cfg.actor.version_gate = False  # no trainer publishes here: a request must not wait for weights that never come
    cfg.pipeline.max_steps = cfg.pipeline.max_samples = 0
    cfg.pipeline.max_minutes = 0
    cfg.server.base_port = free_port()
    argv = server_command(cfg, 0)  # as the launcher starts it: [python, -m, ..., --model M, --host H, --port P, ...]
    at = argv.index("--model")
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    extra = [*argv[at + 6:], "--version-wait-s", "1"]  # the held requests of _request_cost end soon (last wins)
    with ServerProcess(argv[at + 1], host=host, port=port, command=argv[:at], extra_args=extra,
                       env=thread_env(cfg.server.threads)) as server:
        return asyncio.run(_rounds(cfg, server.url, server.proc.pid, list(lengths), groups))
