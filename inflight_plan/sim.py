"""A discrete-event simulation of the RL loop (docs/architecture.md, "One optimizer step, in order"), pipelined and
sync, on a Profile (profile.py) and a SimConfig (workload.py). Pure Python, seeded, a few seconds for thousands of
samples: a server does not simulate one decode step at a time but runs until the next sequence ends, and an outside
event (a new request with room in the batch, a weight update) cuts that run at the next step boundary.

What it models, as the code does:
- the actor starts group k only while k < (published + max_lag + 1 + queue_ahead if gated) x groups_per_step (the
  bound of inflight/config/limits.py, sync mode's num_grad_steps - 1 as max_lag), at most
  `concurrency_per_server` requests per server, each to the server with the fewest outstanding; a gated request
  carries min_weight_version = k // groups_per_step - max_lag and the server holds it until it has that version;
- a server: continuous batching up to max_batch (FIFO), one decode step of b sequences of mean context c takes
  t(b, c) x run_step_factor, newly admitted prompts cost prompt tokens / prefill tokens/s (likewise scaled) before
  the step; an update is swapped in at the next step boundary (pause_s); in `interrupt` mode the running sequences
  are re-prefilled (prompt + generated);
- a server is two threads: the engine's, and an HTTP thread that works through its queue one item at a time: a
  group's requests (`server_s_per_request`: the group joins the batch's queue once they are parsed), a finished
  group's reply (`server_s_per_group` + `server_s_per_token` x its completion tokens), a weight update's request
  (which thus waits behind the requests that came before it). The engine thread loses `server_http_stall` x that
  work (the interpreter lock): at the next step boundary for requests that arrive while it runs, at once for
  replies. A reply then costs the actor `actor_s_per_group` + `actor_s_per_token` x tokens of serial work and
  reaches the trainer `overhead_s` later, which spends `trainer_s_per_group` + `trainer_s_per_token` x tokens
  reading it;
- the trainer takes the step's groups in start order and back-propagates each as it arrives (trained_frac of the
  tokens its forward runs over, the prompt once and every completion, at the profile's rate per such token for T
  devices: TrainerProfile.forward_tokens_per_s_at, scaled by the group's mean length: length_factor), waits for
  the previous push, then the optimizer step (step_overhead_s); the version is published at once when gated, else
  when the push has reached every server; pipelined: a push after every step; sync: the round's first step waits
  for all of its num_grad_steps x groups_per_step groups, and the push follows the round's last step. A push takes
  push_s, plus push_beside_train_s if the trainer starts its next step at once, push_beside_decode_s if a server
  is decoding as it starts, push_beside_both_s if both (the push's threads share cores and interpreters with them).
Where the roles share `cores` cores, each wake-up of the actor's loop and of a server's HTTP thread to handle a
group waits wakeup_wait_s while the other threads take every core. Not modelled here: the roles' slowing each
other on shared cores (contention.py: from the busy threads this records), evaluation requests, failures, the
actor's HTTP concurrency.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from inflight_plan.profile import Profile
from inflight_plan.workload import SimConfig


class _Group:
    __slots__ = ("index", "min_version", "lengths", "admitted", "left", "server", "versions")

    def __init__(self, index: int, min_version: int, lengths: list[int], server: int):
        self.index, self.min_version, self.lengths, self.server = index, min_version, lengths, server
        self.admitted = 0  # sequences admitted to the batch so far
        self.left = len(lengths)  # sequences not finished
        self.versions: dict[int, int] = {}  # weight version -> completion tokens sampled with it


class _Server:
    def __init__(self, k: int):
        self.k = k
        self.counter = 0  # decode steps done
        self.version = 0
        self.changes: list[int] = [0]  # counter at which each version change took effect
        self.change_versions: list[int] = [0]
        self.heap: list[tuple[int, int, int, _Group]] = []  # (finish counter, tie, start counter, group) running
        self.ctx_base = 0  # sum over running sequences of (prompt - start counter); + b * counter = total context
        self.waiting: deque[_Group] = deque()
        self.pending: int | None = None  # a version that arrived and waits for the next step boundary
        self.http_free = 0.0  # when its HTTP thread is next free (busy while > now: its work queues back to back)
        self.stall_s = 0.0  # seconds the engine thread owes the HTTP thread's work, paid at the next step boundary
        self.stalled = False  # paused only for that: the engine thread waits on the lock (server_http_spin: partly)
        self.chunk: tuple[int, float, float, float, int, int] | None = None  # (id, t0, steps start, dt, n, b)
        self.paused = False
        self.kick_due = False  # a "kick" event is queued (all of one instant's arrivals join the same batch)
        self.cid = 0  # id of the latest run: the end event of a run that was cut carries an older one
        self.outstanding = 0
        self.busy = 0.0
        self.batch_time = 0.0  # integral of the batch over decode time
        self.decode_time = 0.0
        self.tokens = 0

    def context_sum(self) -> int:
        return self.ctx_base + len(self.heap) * self.counter


@dataclass
class SimResult:
    config: SimConfig
    source: str  # the profile's source: every figure below is a prediction from it
    step_end_s: list[float]  # time of each optimizer step (from the start, servers ready)
    samples_per_step: int
    lag_hist: dict[int, int]  # trainer version - token version -> completion tokens
    server_busy: list[float]  # share of the run each server was decoding, prefilling or paused
    server_mean_batch: float  # mean batch while decoding (time-weighted): how full the batches stayed
    trainer_busy: float
    server_tokens_per_s: float  # generated tokens per second, all servers
    extra: dict = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return self.step_end_s[-1]

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step * len(self.step_end_s) / self.wall_s

    def steady_samples_per_s(self, first: int) -> float:
        """Samples per second between the end of step `first` (1-based) and the last step: no pipeline fill."""
        n = len(self.step_end_s)
        if not 1 <= first < n:
            return self.samples_per_s
        return self.samples_per_step * (n - first) / (self.step_end_s[-1] - self.step_end_s[first - 1])

    @property
    def seconds_per_step(self) -> float:
        return self.wall_s / len(self.step_end_s)

    def time_to_samples(self, n: int) -> float | None:
        """Seconds until the optimizer step that brings the samples trained to n (None: not within the run)."""
        k = math.ceil(n / self.samples_per_step)
        return self.step_end_s[k - 1] if 1 <= k <= len(self.step_end_s) else (0.0 if k < 1 else None)

    def lag_share(self) -> dict[int, float]:
        total = sum(self.lag_hist.values()) or 1
        return {k: v / total for k, v in sorted(self.lag_hist.items())}


class Simulator:
    def __init__(self, profile: Profile, cfg: SimConfig, occupancy: bool = False, cores: float = 0.0):
        self.p, self.cfg = profile, cfg
        self.cores = cores  # the roles share this many cores (0: each on devices of its own)
        self.track = occupancy  # record the busy states (contention.py needs them; O(servers) per event)
        self.rng = random.Random(cfg.seed)
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.now = 0.0
        self.servers = [_Server(k) for k in range(cfg.servers)]
        self.started = 0
        self.published = 0
        self.bound = cfg.staleness  # config/limits.py: what the actor and the trainer apply
        self.total_groups = cfg.steps * cfg.groups_per_step
        self.ready: dict[int, _Group] = {}
        self.next_group = 0  # next group (start order) the trainer back-propagates
        self.version = 0  # trainer's weights
        self.trainer_busy = False
        self.trainer_time = 0.0
        self.push_end = 0.0
        self.step_end: list[float] = []
        self.lag: dict[int, int] = {}
        self.actor_free = 0.0  # when the actor's serial per-group work is next free
        # time spent in each (trainer threads busy: compute + push, engine threads busy, engine threads stalled by
        # their HTTP thread, HTTP threads busy, actor busy) state: what shares the cores (contention.py)
        self.occupancy: dict[tuple[int, int, int, int, int], float] = {}
        self.stall = profile.server_http_stall
        # per token the trainer computes: a group's prompt once (trainer/prefix.py), then its completions
        self.tok_s = profile.trainer.forward_tokens_per_s_at(cfg.trainer_devices, cfg.group_size)
        # a run's steps cost run_step_factor x plain ones (traffic.py): its decode and prefill alike
        self.step_factor = profile.engine.run_step_factor
        self.prefill = profile.engine.prefill_tokens_per_s / self.step_factor

    # -- the event queue ----------------------------------------------------------------------------------------
    def _at(self, t: float, kind: str, obj: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def run(self) -> SimResult:
        self._actor()
        self._trainer()
        while self.events and len(self.step_end) < self.cfg.steps:
            t, _, kind, obj = heapq.heappop(self.events)
            if self.track and t > self.now:
                state = (int(self.trainer_busy) + int(self.push_end > self.now),  # the push works on a thread
                         sum(s.chunk is not None or (s.paused and not s.stalled) for s in self.servers),
                         sum(s.stalled for s in self.servers),
                         sum(s.http_free > self.now for s in self.servers),
                         int(self.actor_free > self.now))
                self.occupancy[state] = self.occupancy.get(state, 0.0) + t - self.now
            self.now = t
            getattr(self, "_on_" + kind)(obj)
        if len(self.step_end) < self.cfg.steps:
            raise RuntimeError(f"simulation stalled after {len(self.step_end)} steps (a bug, or a config that can "
                               "never fill a step)")
        end = self.step_end[-1]
        dec = sum(s.decode_time for s in self.servers)
        return SimResult(
            config=self.cfg, source=self.p.source, step_end_s=list(self.step_end),
            samples_per_step=self.cfg.groups_per_step * self.cfg.group_size, lag_hist=dict(sorted(self.lag.items())),
            server_busy=[min(1.0, s.busy / end) for s in self.servers],
            server_mean_batch=sum(s.batch_time for s in self.servers) / dec if dec else 0.0,
            trainer_busy=min(1.0, self.trainer_time / end),
            server_tokens_per_s=sum(s.tokens for s in self.servers) / end, extra={"occupancy": self.occupancy})

    # -- actor ----------------------------------------------------------------------------------------------------
    def _allowed(self) -> int:
        return min(self.total_groups, self.bound.groups_allowed(self.published))

    def _actor(self) -> None:
        c = self.cfg
        while self.started < self._allowed():
            free = [s for s in self.servers if s.outstanding < c.concurrency_per_server]
            if not free:
                return
            srv = min(free, key=lambda s: s.outstanding)
            k = self.started
            min_v = self.bound.request_min_version(k)
            g = _Group(k, min_v, [c.lengths.sample(self.rng) for _ in range(c.group_size)], srv.k)
            self.started += 1
            srv.outstanding += 1
            if self.p.server_s_per_request > 0:  # parsed on the server's HTTP thread first
                self._at(self._http(srv, self.p.server_s_per_request), "arrive", (srv, g))
            else:
                self._on_arrive((srv, g))

    def _http(self, srv: _Server, cost: float) -> float:
        """Queues `cost` seconds of work on the server's HTTP thread; returns when it is done."""
        srv.http_free = max(self.now, srv.http_free) + cost
        return srv.http_free

    def _on_arrive(self, obj: tuple[_Server, _Group]) -> None:
        srv, g = obj
        c = self.cfg
        srv.waiting.append(g)
        if srv.chunk is not None:  # parsed while the engine decoded: it lost its share of that time
            srv.stall_s += self.stall * self.p.server_s_per_request
        self._poke(srv, admissible=(g.min_version <= srv.version and len(srv.heap) < c.max_batch) or srv.stall_s > 0)

    # -- servers --------------------------------------------------------------------------------------------------
    def _poke(self, srv: _Server, admissible: bool) -> None:
        """Something changed for `srv`: start it if idle, or cut its run at the next step boundary."""
        if srv.paused:
            return
        if srv.chunk is None:
            self._kick_soon(srv)
            return
        if not admissible:
            return
        cid, t0, start, dt, n, b = srv.chunk
        k = max(1, math.ceil((self.now - start) / dt - 1e-9))
        if k < n:
            srv.cid += 1
            srv.chunk = (srv.cid, t0, start, dt, k, b)
            self._at(start + k * dt, "chunk", (srv, srv.cid))

    def _kick_soon(self, srv: _Server) -> None:
        if not srv.kick_due:
            srv.kick_due = True
            self._at(self.now, "kick", srv)

    def _on_kick(self, srv: _Server) -> None:
        srv.kick_due = False
        if srv.chunk is None and not srv.paused:
            self._kick(srv)

    def _kick(self, srv: _Server) -> None:
        """The server is free at self.now: swap in a pending update, admit waiting sequences, run until the next
        sequence ends."""
        c, t = self.cfg, self.now
        if srv.stall_s > 0:  # what the HTTP thread's work took from the engine thread in the last run
            cost, srv.stall_s = srv.stall_s, 0.0
            self._pause(srv, cost, stalled=True)
            return
        if srv.pending is not None:
            cost = self.p.pause_s
            if c.update_mode == "interrupt" and srv.heap:
                cost += srv.context_sum() / self.prefill
            srv.version, srv.pending = srv.pending, None
            srv.changes.append(srv.counter)
            srv.change_versions.append(srv.version)
            self._pause(srv, cost)
            return
        prefill_tokens = 0
        while srv.waiting and len(srv.heap) < c.max_batch and srv.waiting[0].min_version <= srv.version:
            g = srv.waiting[0]
            length = g.lengths[g.admitted]
            if g.admitted == 0 or not c.share_prompt:
                prefill_tokens += c.prompt_tokens
            self.seq += 1
            heapq.heappush(srv.heap, (srv.counter + length, self.seq, srv.counter, g))
            srv.ctx_base += c.prompt_tokens - srv.counter
            g.admitted += 1
            if g.admitted == len(g.lengths):
                srv.waiting.popleft()
        if not srv.heap:
            srv.chunk = None
            return
        b = len(srv.heap)
        n = srv.heap[0][0] - srv.counter
        ctx = srv.context_sum() / b + n / 2
        dt = self.p.engine.decode.step_time(b, ctx) * self.step_factor
        start = t + prefill_tokens / self.prefill
        srv.cid += 1
        srv.chunk = (srv.cid, t, start, dt, n, b)
        self._at(start + n * dt, "chunk", (srv, srv.cid))

    def _on_chunk(self, obj: tuple[_Server, int]) -> None:
        srv, cid = obj
        if srv.chunk is None or srv.chunk[0] != cid:
            return  # a run that was cut: its later end is void
        _, t0, start, dt, n, b = srv.chunk
        srv.chunk = None
        srv.counter += n
        srv.busy += self.now - t0
        srv.decode_time += n * dt
        srv.batch_time += n * dt * b
        srv.tokens += n * b
        cost = 0.0
        while srv.heap and srv.heap[0][0] <= srv.counter:
            finish, _, begin, g = heapq.heappop(srv.heap)
            srv.ctx_base -= self.cfg.prompt_tokens - begin
            self._count_versions(srv, g, begin, finish)
            g.left -= 1
            if g.left == 0:
                srv.outstanding -= 1
                completion = sum(g.lengths)
                reply = self.p.server_reply_s(completion)
                cost += reply
                # the replies go out one after another; waking up for each waits where the cores are taken
                sent = self._http(srv, reply + self._wake_wait(self.p.server_wakeups_per_group, srv))
                self.actor_free = (max(sent, self.actor_free) + self.p.actor_reply_s(completion)
                                   + self._wake_wait(self.p.actor_wakeups_per_group))
                self._at(self.actor_free + self.p.overhead_s, "group", g)
                self._actor()
        if cost * self.stall > 0:  # the engine thread loses its share while the HTTP thread answers
            self._pause(srv, cost * self.stall, stalled=True)
            return
        self._kick_soon(srv)

    def _wake_wait(self, wakeups: float, http: _Server | None = None) -> float:
        """Where the roles share cores, the waits for one of a thread that wakes up `wakeups` times to handle a
        group (the actor's loop; with `http`, that server's HTTP thread): each wake-up waits wakeup_wait_s while the
        other threads (the trainer's, the push's, each engine with sequences to run, the busy HTTP threads, the
        actor) take every core. A latency on that thread's path, which the occupancy counts as its work."""
        if not self.cores or not wakeups:
            return 0.0
        others = (int(self.trainer_busy) + int(self.push_end > self.now)
                  + sum(s.chunk is not None or (s.paused and not s.stalled) or self._unfinished(s)
                        for s in self.servers)
                  + sum(s.http_free > self.now for s in self.servers if s is not http)
                  + int(http is not None and self.actor_free > self.now))
        return wakeups * self.p.wakeup_wait_s if others >= self.cores else 0.0

    @staticmethod
    def _unfinished(srv: _Server) -> bool:
        """Sequences left to decode (a run that just ended: its last steps' sequences are being answered)."""
        return any(finish > srv.counter for finish, *_ in srv.heap)

    def _pause(self, srv: _Server, seconds: float, stalled: bool = False) -> None:
        srv.busy += seconds
        srv.paused, srv.stalled = True, stalled
        self._at(self.now + seconds, "resume", srv)

    @staticmethod
    def _count_versions(srv: _Server, g: _Group, begin: int, finish: int) -> None:
        """The version of each token of steps [begin, finish): a change at counter c applies to steps >= c."""
        i = bisect.bisect_right(srv.changes, begin) - 1
        pos = begin
        while pos < finish:
            nxt = srv.changes[i + 1] if i + 1 < len(srv.changes) else finish
            upto = min(nxt, finish)
            if upto > pos:
                v = srv.change_versions[i]
                g.versions[v] = g.versions.get(v, 0) + upto - pos
            pos = upto
            i += 1

    def _on_resume(self, srv: _Server) -> None:
        srv.paused = srv.stalled = False
        self._kick_soon(srv)

    def _on_update(self, obj: int) -> None:
        version = int(obj)
        for srv in self.servers:  # its request is read by the HTTP thread, after the work queued before it
            if srv.http_free > self.now:
                self._at(srv.http_free, "swap", (srv, version))
            else:
                self._on_swap((srv, version))
        if not self.cfg.gated:
            self._publish(version)

    def _on_swap(self, obj: tuple[_Server, int]) -> None:
        srv, version = obj
        srv.pending = version
        self._poke(srv, admissible=True)

    # -- trainer --------------------------------------------------------------------------------------------------
    def _on_group(self, g: _Group) -> None:
        self.ready[g.index] = g
        self._trainer()

    def _trainer(self) -> None:
        c = self.cfg
        if self.trainer_busy or len(self.step_end) >= c.steps:
            return
        gps = c.groups_per_step
        step = self.version
        if c.mode == "sync" and step % c.num_grad_steps == 0 and self.next_group == step * gps:
            round_end = min(self.total_groups, (step + c.num_grad_steps) * gps)
            if any(k not in self.ready for k in range(self.next_group, round_end)):
                return  # the conventional loop: a round trains only once all of it is generated
        if self.next_group < (step + 1) * gps:
            g = self.ready.get(self.next_group)
            if g is None:
                return
            forward = c.prompt_tokens + sum(g.lengths)  # what the trainer's forward runs over for this group
            cost = self.p.trainer.length_factor(sum(g.lengths) / len(g.lengths)) / self.tok_s
            work = c.trained_frac * forward * cost + self.p.trainer_read_s(sum(g.lengths))
            self.trainer_busy = True
            self.trainer_time += work
            self._at(self.now + work, "backward", None)
            return
        start = max(self.now, self.push_end)  # the optimizer writes the weights the previous push reads
        self.trainer_busy = True
        self.trainer_time += self.p.trainer.step_overhead_s
        self._at(start + self.p.trainer.step_overhead_s, "optimizer", None)

    def _on_backward(self, _: object) -> None:
        self.trainer_busy = False
        self.next_group += 1
        self._trainer()

    def _on_optimizer(self, _: object) -> None:
        c = self.cfg
        self.trainer_busy = False
        trained_at = self.version
        for k in range(trained_at * c.groups_per_step, (trained_at + 1) * c.groups_per_step):
            for v, n in self.ready.pop(k).versions.items():
                self.lag[trained_at - v] = self.lag.get(trained_at - v, 0) + n
        self.version += 1
        self.step_end.append(self.now)
        push = c.mode == "pipelined" or self.version % c.num_grad_steps == 0
        if push and c.gated:
            self._publish(self.version)
        self._trainer()  # the next step starts now if its first group is in: the push then runs beside it
        if push:
            self.push_end = self.now + self._push_s()
            self._at(self.push_end, "update", self.version)

    def _push_s(self) -> float:
        """The push's seconds: alone, and more when the trainer trains or a server decodes as it starts."""
        decoding = any(s.chunk is not None for s in self.servers)
        extra = {(False, False): 0.0, (True, False): self.p.push_beside_train_s,
                 (False, True): self.p.push_beside_decode_s, (True, True): self.p.push_beside_both_s}
        return self.p.push_s + extra[self.trainer_busy, decoding]

    def _publish(self, version: int) -> None:
        self.published = max(self.published, version)
        self._actor()


def simulate(profile: Profile, cfg: SimConfig, occupancy: bool = False, cores: float = 0.0) -> SimResult:
    """Runs the loop until cfg.steps optimizer steps; with `occupancy`, result.extra["occupancy"] holds the seconds
    spent in each (trainer threads, engine threads, stalled engine threads, HTTP threads, actor) busy state; `cores`:
    the roles share that many cores (wake-ups then wait for one: Simulator._wake_wait)."""
    return Simulator(profile, cfg, occupancy, cores).run()
