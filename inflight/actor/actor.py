"""The actor: turns prompts into scored groups as fast as the servers allow, never further ahead of the trainer than
the staleness bound.

One coroutine per group (rollout -> reward service -> completed list; samples the rollout labelled itself, the
episodes of a multi-turn environment (actor/episode.py), skip the reward service). A scheduler loop starts groups while

    groups_started < (trainer_version + max_lag + 1) * groups_per_step        (AReaL's rule; max_lag=0: on-policy)

with `trainer_version` read from the stream (published by the trainer, -1 before its first publish), and puts
completed groups into the stream, oldest first. A group that fails (all retries spent) is logged, counted in
`groups_failed`, and its slot is given back so that a fresh prompt replaces it: the trainer never waits for a group
that will not come. `max_failed_in_a_row` groups failing one after another (a broken rollout function or server,
not a passing fault) stop the actor with the last error. With `dynamic_sampling`, a group whose rewards are all
equal is dropped the same way (its slot given back, a fresh prompt started) but still delivered, marked, so the
trainer need not wait for it (algo/dynamic_sampling.py).

A group's requests carry the oldest weight version its tokens may have: that of its slot, the number of live groups
started before it (the step it is trained in is at most slot // groups_per_step, earlier when groups before it
were given up), so its tokens are never older than the bound allows, and it is never held for weights the trainer
can only make after training it.

Resume (`first_group`, `groups_given_up`, `min_version` from a trainer checkpoint): group k always gets the k-th
prompt of the task's training order, so the actor skips the first `first_group` prompts and numbers its groups
from there; the counters the bound reads are rebased on the checkpoint (live groups = groups trained), and nothing
starts before the trainer publishes the checkpoint's version (the servers hold its weights by then). Without the
rebase a fresh counter would start (version + max_lag + 1) x groups_per_step groups at once: AReaL's lag overrun.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from inflight.actor.evaluate import evaluate
from inflight.actor.rollout import RolloutClient, RolloutFn, default_rollout
from inflight.actor.server_pool import ServerPool
from inflight.algo.dynamic_sampling import DROP, Refill, model_tokens
from inflight.config.actor import ActorConfig
from inflight.config.limits import Staleness, actor_staleness
from inflight.contracts import Group, Stream, Task, TaskSample, Verification

log = logging.getLogger(__name__)

MetricsSink = Callable[[dict[str, Any]], None]


class Scorer(Protocol):
    """The reward service (inflight.rewards.RewardService) as the actor uses it."""

    async def score(self, items: list[tuple[str, TaskSample, str, int, int]]) -> list[Verification]: ...


class _StopFlag(Protocol):
    def is_set(self) -> bool: ...


@dataclass
class ActorMetrics:
    groups_started: int = 0
    groups_completed: int = 0  # scored and handed to the stream
    groups_failed: int = 0  # could not complete (reported in Actor.failures)
    groups_cancelled: int = 0  # still running when a stop event came
    groups_dropped: int = 0  # dynamic sampling: rewards all equal, delivered marked, slot given back
    groups_capped: int = 0  # dynamic sampling: rewards all equal on a place's last try, kept
    tokens_dropped: int = 0  # the model's tokens in dropped groups
    samples_completed: int = 0
    tokens_generated: int = 0
    max_in_flight: int = 0
    episodes: int = 0  # multi-turn episodes (samples with meta["turns"])
    episode_sums: dict[str, float] = field(default_factory=dict)  # turns, env tokens, env metrics (tool_calls)
    t0: float = field(default_factory=time.monotonic)

    def count_episode(self, meta: dict[str, Any]) -> None:
        self.episodes += 1
        for k in (*("turns", "env_tokens", "tool_calls", "tool_errors"), *(k for k in meta if k.startswith("vf_"))):
            if isinstance(meta.get(k), (int, float)):  # vf_*: a verifiers rubric's metrics (tasks/verifiers_env.py)
                self.episode_sums[k] = self.episode_sums.get(k, 0.0) + float(meta[k])

    @property
    def in_flight(self) -> int:
        return self.groups_started - self.groups_completed - self.groups_failed - self.groups_cancelled

    def snapshot(self) -> dict[str, float]:
        dt = max(time.monotonic() - self.t0, 1e-9)
        return {
            "actor/groups_started": self.groups_started,
            "actor/groups_completed": self.groups_completed,
            "actor/groups_failed": self.groups_failed,
            "actor/groups_cancelled": self.groups_cancelled,
            "actor/groups_dropped": self.groups_dropped,
            "actor/groups_capped": self.groups_capped,
            "actor/tokens_dropped": self.tokens_dropped,
            "actor/groups_in_flight": self.in_flight,
            "actor/max_groups_in_flight": self.max_in_flight,
            "actor/samples": self.samples_completed,
            "actor/samples_per_s": self.samples_completed / dt,
            "actor/tokens_per_s": self.tokens_generated / dt,
            "actor/elapsed_s": dt,
            **{f"actor/episode_{k}_mean": v / max(1, self.episodes) for k, v in self.episode_sums.items()},
        }


class Actor:
    def __init__(
        self,
        cfg: ActorConfig,
        task: Task,
        pool: ServerPool,
        rewards: Scorer,
        stream: Stream,
        *,
        rollout: RolloutFn = default_rollout,
        model: str | None = None,  # None = ask the servers (GET /v1/models)
        seed: int = 0,
        max_groups: int = 0,  # 0 = no limit: stop after this many groups were delivered
        max_seconds: float = 0.0,  # 0 = no limit
        metrics_sink: MetricsSink | None = None,
        poll_s: float = 0.02,
        first_group: int = 0,  # resume: index of the first group to start (= prompts already used)
        groups_given_up: int = 0,  # resume: indices below first_group that were never delivered
        min_version: int = -1,  # resume: start nothing before the trainer publishes this version
        served: Callable[[int], str | None] | None = None,  # stock vLLM LoRA: version -> adapter name (rollout.py)
        staleness: Staleness | None = None,  # the run's bound (config/limits.py); None = cfg's, pipelined
    ):
        self.staleness = staleness or actor_staleness(cfg)
        if self.staleness.max_lag < 0 or cfg.groups_per_step < 1 or cfg.group_size < 1:
            raise ValueError("actor needs max_lag >= 0, groups_per_step >= 1, group_size >= 1")
        self.cfg, self.task, self.pool, self.rewards, self.stream = cfg, task, pool, rewards, stream
        self.rollout = rollout
        self.client = RolloutClient(pool, cfg, model, served=served)
        self.prompts = task.train_samples(seed)
        for _ in range(first_group):  # group k <-> prompt k: continue the prompt order where it was
            next(self.prompts)
        self.min_version = min_version
        self.max_groups, self.max_seconds = max_groups, max_seconds
        self.metrics_sink = metrics_sink
        self.poll_s = poll_s
        self.metrics = ActorMetrics(groups_started=first_group, groups_failed=groups_given_up,
                                    groups_completed=first_group - groups_given_up)
        self.start_log: list[tuple[int, int]] = []  # (group index, trainer version when it started)
        self.failures: list[dict[str, Any]] = []
        self.eval_results: list[dict[str, Any]] = []
        self._done: list[tuple[int, Group]] = []  # completed, not yet in the stream
        self._tasks: set[asyncio.Task] = set()
        self._wake: asyncio.Event | None = None
        self._seen_version = -1
        self._failed_in_a_row = 0
        self.refill = Refill(cfg.dynamic_sampling_max_tries) if cfg.dynamic_sampling else None
        # in-run evaluations so far: picks the rotating subset's window (a resumed run continues near where it was)
        self._eval_round = max(0, min_version) // cfg.eval_every if cfg.eval_every > 0 else 0

    # ------------------------------------------------------------------------------------------------ one group
    def bound(self, trainer_version: int) -> int:
        """How many groups may have been started (excluding failed ones) at this trainer version."""
        return self.staleness.groups_allowed(trainer_version)

    @property
    def live_groups(self) -> int:
        """Groups started that are (or will be) trained: the count the staleness bound applies to (failed and
        dropped groups gave their slots back)."""
        return self.metrics.groups_started - self.metrics.groups_failed - self.metrics.groups_dropped

    async def _run_group(self, index: int, ts: TaskSample, start_version: int, slot: int, tries: int = 1) -> None:
        try:
            # with `served`, the group runs under the adapter of the version published when it started (exact)
            client = self.client.for_group(self.oldest_version(slot), version=start_version)
            samples = await self.rollout(ts, client, self.cfg)
            if not samples:
                raise RuntimeError("the rollout returned no samples")
            todo = [s for s in samples if not s.label]  # a labelled sample was scored by its rollout (episodes)
            items = [
                (s.meta.get("text", ""), ts, s.finish_reason, len(s.completion_ids), self.cfg.max_new_tokens)
                for s in todo
            ]
            verdicts = await self.rewards.score(items) if items else []
            for s, v in zip(todo, verdicts, strict=True):
                s.reward = float(v.reward)
                s.label = getattr(v.label, "value", str(v.label))
            for s in samples:
                s.group_id = f"g{index}"
                s.meta.update(group_index=index, start_version=start_version)
            if self.refill is not None and self.refill.judge(samples, tries) == DROP:
                self.metrics.groups_dropped += 1  # its slot is free now: the loop starts a fresh prompt
                self.metrics.tokens_dropped += model_tokens(samples)
            elif self.refill is not None:
                self.metrics.groups_capped = self.refill.capped
            self._done.append((index, samples))
            self._failed_in_a_row = 0
        except Exception as exc:  # reported and counted, never silently dropped
            self.metrics.groups_failed += 1
            if self.refill is not None:
                self.refill.failed(tries)
            self._failed_in_a_row += 1
            self.failures.append({"group_index": index, "task_id": ts.id, "error": f"{type(exc).__name__}: {exc}"})
            log.error("group %d (prompt %s) failed: %s: %s", index, ts.id, type(exc).__name__, exc)
        finally:
            if self._wake is not None:
                self._wake.set()

    def oldest_version(self, slot: int) -> int:
        """The oldest weights the group started in live slot `slot` may be sampled from: it is trained on weights
        slot // groups_per_step at the latest, so its tokens must be at most max_lag versions older (0 = any)."""
        return self.staleness.request_min_version(slot)

    def _start_group(self, trainer_version: int) -> asyncio.Task:
        index, slot = self.metrics.groups_started, self.live_groups
        tries = self.refill.next_try() if self.refill is not None else 1
        self.metrics.groups_started += 1
        self.metrics.max_in_flight = max(self.metrics.max_in_flight, self.metrics.in_flight)
        self.start_log.append((index, trainer_version))
        t = asyncio.create_task(self._run_group(index, next(self.prompts), trainer_version, slot, tries))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _flush(self) -> list[Group]:
        """Put completed groups into the stream, oldest first (lowest first version, then start order)."""
        if not self._done:
            return []
        done = sorted(self._done, key=lambda d: (min(s.first_version for s in d[1]), d[0]))
        self._done = []
        groups = [g for _, g in done]
        await self._deliver(groups)
        return groups

    async def _deliver(self, groups: list[Group], put: bool = True) -> None:
        if put:  # a stream's put may block (bounded queue, network): keep the event loop free
            await asyncio.to_thread(self.stream.put, groups)
        self.metrics.groups_completed += len(groups)
        self.metrics.samples_completed += sum(len(g) for g in groups)
        self.metrics.tokens_generated += sum(len(s.completion_ids) if s.loss_mask is None else sum(s.loss_mask)
                                             for g in groups for s in g)  # the model's tokens, not an env's
        for s in (s for g in groups for s in g if "turns" in s.meta):
            self.metrics.count_episode(s.meta)

    # ------------------------------------------------------------------------------------------------ main loop
    def _limit_reached(self) -> bool:
        if self.max_groups and self.live_groups >= self.max_groups:
            return True
        return bool(self.max_seconds) and time.monotonic() - self.metrics.t0 >= self.max_seconds

    async def run(self, stop_event: _StopFlag | None = None) -> dict[str, Any]:
        """Generate until `stop_event` is set or a limit is reached; returns the final metrics."""
        self._wake = asyncio.Event()
        last_eval: int | None = None
        eval_task: asyncio.Task | None = None
        next_report = time.monotonic() + self.cfg.metrics_interval_s
        stopped = False
        while True:
            if stop_event is not None and stop_event.is_set():
                stopped = True
                break
            limit = self.cfg.max_failed_in_a_row
            if limit and self._failed_in_a_row >= limit:  # a broken rollout or server: fail loudly, do not spin
                raise RuntimeError(f"{self._failed_in_a_row} groups failed in a row; the last: "
                                   f"{self.failures[-1]['error']}")
            tv = self._seen_version = self.stream.trainer_version()
            if last_eval is None and self.cfg.eval_every > 0 and self.cfg.eval_base and self.min_version <= 0 \
                    and self.metrics.groups_started == 0:
                # a fresh run's base model, before RL (and before the trainer's first publish, which may still be
                # loading): no rollout has started, so the servers stay at version 0 throughout
                last_eval = 0
                await self._evaluate(base=True)
                continue
            if self.cfg.eval_every > 0 and tv >= 0 and (last_eval is None or tv >= last_eval + self.cfg.eval_every):
                if eval_task is None or eval_task.done():
                    last_eval = tv
                    eval_task = asyncio.create_task(self._evaluate())
            while tv >= self.min_version and not self._limit_reached() and self.live_groups < self.bound(tv):
                self._start_group(tv)
            await self._flush()
            if self._limit_reached() and self.metrics.in_flight == 0:
                break
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + self.cfg.metrics_interval_s
                self._report()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll_s)
            except asyncio.TimeoutError:
                pass
        if not stopped and eval_task is not None:  # limits reached: let a running evaluation finish
            await eval_task
        groups = list(self._tasks)
        pending = groups + ([eval_task] if eval_task is not None and not eval_task.done() else [])
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.metrics.groups_cancelled += sum(t.cancelled() for t in groups)
        try:
            await self._flush()  # groups that completed before the stop still go out
        except Exception as exc:  # e.g. the launcher closed the stream while shutting down
            if not stopped:
                raise
            log.warning("actor stopping: could not hand over the last groups: %s: %s", type(exc).__name__, exc)
        if stopped:
            log.info("actor stopped by its stop event; %d groups cancelled", self.metrics.groups_cancelled)
        return self._report()

    async def generate_round(self, num_groups: int, put: bool = True) -> list[Group]:
        """Sync mode: generate exactly `num_groups` groups now (no staleness bound: the caller holds the weights
        fixed), wait for all of them, put them in the stream (if `put`) and return them in start order. Failed
        groups are replaced by fresh prompts, up to `num_groups` replacements, then RuntimeError; with dynamic
        sampling, dropped ones too (returned and delivered as well, marked), until `num_groups` are kept."""
        self._wake = asyncio.Event()
        first, tv, failed = self.metrics.groups_started, self.stream.trainer_version(), self.metrics.groups_failed
        while (todo := num_groups - sum(1 for i, g in self._done if i >= first and not g[0].meta.get("dropped"))) > 0:
            if self.metrics.groups_failed - failed > num_groups:
                raise RuntimeError(f"generate_round: {self.metrics.groups_failed} groups failed; see actor.failures")
            await asyncio.gather(*(self._start_group(tv) for _ in range(todo)))
        mine = sorted((d for d in self._done if d[0] >= first), key=lambda d: d[0])
        self._done = [d for d in self._done if d[0] < first]
        groups = [g for _, g in mine]
        await self._deliver(groups, put)
        return groups

    # ------------------------------------------------------------------------------------------------ reporting
    async def _evaluate(self, base: bool = False) -> None:
        subset, index = (0, 0) if base else (self.cfg.eval_subset, self._eval_round)
        if not base:
            self._eval_round += 1
        try:
            res = await evaluate(self.task, self.pool, self.cfg, rewards=self.rewards, model=self.client.model,
                                 episode=getattr(self.rollout, "episode", None), served=self.client.served,
                                 version=0 if base else self.stream.trainer_version, subset=subset,
                                 round_index=index)
        except Exception as exc:
            log.error("evaluation failed: %s: %s", type(exc).__name__, exc)
            return
        res["trainer_version"] = 0 if base else self.stream.trainer_version()
        res["base"] = base
        if base:
            log.info("base model held-out accuracy (before RL, weight version 0): %.1f%% of %d problems, %.1f s",
                     100 * res["pass@1"], res["num_problems"], res["seconds"])
        self.eval_results.append(res)
        if self.metrics_sink is not None:
            self.metrics_sink({"kind": "eval", **res})

    def _report(self) -> dict[str, Any]:
        # trainer_version: the version the bound used last (what the trainer published)
        snap: dict[str, Any] = {**self.metrics.snapshot(), **self.pool.stats(), "trainer_version": self._seen_version}
        if self.metrics_sink is not None:
            self.metrics_sink({"kind": "actor", **snap})
        return snap
