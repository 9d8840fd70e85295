"""The trainer role: groups from the stream -> advantages -> packed micro-batches -> backward -> optimizer step ->
weights to every server -> version published on the stream. One loop for both modes:

- pipelined: weights go to the servers after every optimizer step (in flight, `update_mode` keep | interrupt);
- sync: after every `num_grad_steps` steps only, so the steps of one round train on data of lag 0, 1, ..., n-1. As in
  the conventional loop, a round's first step waits until every group of the round has been generated: no training
  overlaps that round's generation.

Exactly `groups_per_step` groups make one optimizer step, oldest first (the stream is ordered); with
`actor.dynamic_sampling` the groups the actor dropped (rewards all equal) are passed over and logged, not counted
(algo/dynamic_sampling.py), so the step holds groups_per_step groups with a learning signal. Micro-batches are
packed and back-propagated while the step's groups are still arriving, except for token normalisation, which needs
the step's token count first.

Completions cut off by the length limit are handled per `algo.truncated` (inflight/algo/truncation.py): under `mask`
they are left out of the backward and of the token count, while their rewards still count in their groups'
baselines and the sequence count (`sequences` normalisation) still counts them. Every step logs completion lengths
and endings (trainer/loop/completions.py) and warns when the truncated share stays high.

REINFORCE++ (`algo.advantage: reinforce_pp | reinforce_pp_baseline`, algo/reinforce_pp.py) normalises its per-token
advantages over every trained token of the step (with `algo.kl_reward_coef`, after a forward of the reference model),
and GAE (`algo.advantage: gae`, algo/gae.py) needs the critic's values of every sample: their steps back-propagate
only once all their groups are in (loop/step_advantages.py). With a critic, the critic trains on the step's returns
after the policy's backward, while the previous push may still run; during `critic.warmup_steps` the policy does not
train (its optimizer step finds no gradient and leaves the weights as they are; the version still counts the step).

Samples whose advantage is exactly 0 are not back-propagated when the loss has no KL or entropy term: every policy
loss here multiplies its per-token term by A, so their gradient is exactly 0, and the denominators count the whole
step either way (the gradient is the same, the work is not: at 80% accuracy most groups are all right). The loss
stats (ratio, clip and mask fractions, ESS) then describe the trained samples; lag and reward stats, all of them.

The push runs in the background: the next step collects and back-propagates its micro-batches while the weights go
out, and only its optimizer step (the one thing that writes the weights being sent) waits for the push to end. A push
that failed stops the trainer at the next wait. The version the actor's staleness bound counts from is published
once every server holds it, or, with the version gate (`actor.gated`: the actor's requests carry the oldest weight
version they may be sampled from, and inflight's servers hold a request until they have it), right after the
optimizer step: the next groups then wait at the servers instead of for the push's answers and a round trip.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from inflight.config.limits import pipeline_limits, staleness
from inflight.algo import advantages as adv_mod
from inflight.algo import gae, reinforce_pp
from inflight.algo.dynamic_sampling import refill_stats
from inflight.algo.losses import MAX_KEYS, SUM_KEYS, derive_stats, lag_stats, make_loss, merge_stats, normalization_of
from inflight.algo.truncation import trains
from inflight.config import RunConfig
from inflight.contracts import Group, Sample
from inflight.trainer.loop.checkpoint import CheckpointState, save_checkpoint
from inflight.trainer.loop.completions import TruncationAlarm, completion_stats
from inflight.backends import startup_timeout
from inflight.trainer.loop.ordering import StartOrder
from inflight.trainer.loop.step_advantages import CriticWork, StepData, gae_step, per_token_advantages
from inflight.trainer.weight_sync.rejoin import refused, rejoin_weight_group, server_versions
from inflight.trainer.packing import collate, count_loss_tokens, first_fit_decreasing
from inflight.trainer.weight_sync.common import WeightSyncError


class StopTraining(Exception):
    """Raised when a limit (steps, samples, minutes) ends the run while waiting for data."""


def version_mix(samples: list[Sample]) -> dict[str, Any]:
    """Samples whose completion tokens come from more than one weight version (in-flight updates), and the
    trainer version each group was started at (the actor's staleness bound acts on it)."""
    mixed = sum(1 for s in samples if len(set(s.model_versions())) > 1)
    starts = [v for s in samples if (v := s.meta.get("start_version")) is not None]
    return {"mixed_version_samples": float(mixed), "mixed_version_frac": mixed / max(1, len(samples)),
            "start_versions": {str(v): starts.count(v) for v in sorted(set(starts))}}


def needs_prox(cfg: RunConfig) -> bool:
    """Whether the loss takes pi_prox (the trainer's logprobs with the weights before this optimizer step)."""
    return cfg.algo.loss == "decoupled_ppo"


def adapter_of(policy: Any) -> dict[str, Any]:
    """The push's `adapter` keyword for a policy that trains a LoRA adapter (trainer.lora), else nothing (the
    native stock-server clients take no such keyword; with trainer.lora, trainer.protocol=vllm is the adapter client
    of trainer/protocols/vllm_lora.py, and sglang is refused at config time)."""
    spec = getattr(policy, "adapter", None)
    return {"adapter": spec} if spec is not None else {}


def forward_tokens(samples: list[Sample], share_prompts: bool) -> int:
    """Tokens one micro-batch of these samples runs through the model: with shared prompts (trainer/prefix.py)
    each distinct prompt once plus every completion, else every token of every sample."""
    if not share_prompts:
        return sum(len(s) for s in samples)
    prompts = {tuple(s.prompt_ids) for s in samples}
    return sum(len(p) for p in prompts) + sum(len(s.completion_ids) for s in samples)


@dataclass
class _Push:
    """A weight push running on its own thread; `box` gets "res" (the sync client's answer) or "err"."""

    version: int
    thread: threading.Thread
    started: float
    box: dict[str, Any] = field(default_factory=dict)


class TrainerLoop:
    def __init__(self, cfg: RunConfig, policy: Any, stream: Any, sync_client: Any, log: Any, run_dir: str | Path,
                 ref_policy: Any = None, resume: CheckpointState | None = None, critic: Any = None):
        self.cfg = cfg
        self.policy = policy
        self.stream = stream
        self.sync = sync_client
        self.log = log
        self.run_dir = Path(run_dir)
        self.ref_policy = ref_policy
        self.critic = critic if cfg.algo.advantage == gae.ADVANTAGE else None  # the value model (trainer/critic.py)
        if cfg.algo.advantage == gae.ADVANTAGE and critic is None:
            raise ValueError("algo.advantage=gae needs the critic (built by the trainer role)")
        # Dr. GRPO's constant normaliser defaults to the generation limit, which only the run's config knows
        self.algo = replace(cfg.algo, norm_constant=cfg.algo.norm_constant or float(cfg.actor.max_new_tokens))
        self.loss_fn = make_loss(self.algo)
        self.per_step_advantages = cfg.algo.advantage in (*reinforce_pp.STEP_ADVANTAGES, gae.ADVANTAGE)
        # REINFORCE++'s advantages are shifted by the step's mean: none is known to be 0 before the step is whole
        self.skip_zero_advantage = cfg.algo.kl_coef == 0 and cfg.algo.entropy_coef == 0 and not self.per_step_advantages
        self.alarm = TruncationAlarm(cfg.pipeline.warn_truncated_frac, cfg.pipeline.warn_truncated_steps)
        self.samples_trained = 0
        self.started = time.time()
        self.published_version = 0
        self.order = StartOrder(hole_timeout_s=cfg.actor.request_timeout_s * (cfg.actor.retries + 1))
        self._push: _Push | None = None  # the push in flight, if any
        self._warned_capped = False  # dynamic sampling: a step trained groups kept at the try cap
        self.resumed = resume
        if resume is not None:  # continue the counters and the start order where the checkpoint left them
            self.samples_trained = resume.samples_trained
            self.started = time.time() - resume.elapsed_s
            self.order.next_index = resume.next_group
            self.order.skipped = list(resume.skipped_groups)
            self.order.taken = resume.groups_trained
            self.order.dropped = resume.dropped_groups

    # -- limits -----------------------------------------------------------------------------------------------
    def done(self) -> bool:
        p = self.cfg.pipeline
        if p.max_steps and self.policy.version >= p.max_steps:
            return True
        if p.max_samples and self.samples_trained >= p.max_samples:
            return True
        return bool(p.max_minutes and time.time() - self.started >= 60.0 * p.max_minutes)

    def _time_left(self) -> bool:
        p = self.cfg.pipeline
        return not (p.max_minutes and time.time() - self.started >= 60.0 * p.max_minutes)

    def live_cap(self) -> int:
        """The most groups the actor may have started (and not given up) at the version published last: the
        actor's own bound, queued-ahead groups (`actor.queue_ahead`, held at gated servers) included, and its limit.
        All of them here means nothing else is in flight (ordering.py)."""
        cap = staleness(self.cfg).groups_allowed(self.published_version)
        limit = pipeline_limits(self.cfg)[0]
        return min(cap, limit) if limit else cap

    def await_round(self) -> float:
        """Sync mode, the first step of a round: wait until all of the round's groups are in (generate, then train).
        Returns the seconds waited; raises StopTraining if the time limit ends the wait."""
        p, gps = self.cfg.pipeline, self.cfg.actor.groups_per_step
        if p.mode != "sync" or self.policy.version % p.num_grad_steps:
            return 0.0
        need = p.num_grad_steps * gps
        limit = pipeline_limits(self.cfg)[0]
        if limit:  # the last round of a run that ends mid-round
            need = min(need, limit - self.order.taken)
        wait_s = 0.0
        while self.order.live < need:  # dropped groups (dynamic sampling) are not part of the round
            wait_s += self.wait_for_groups(need - self.order.live)
        return wait_s

    def wait_for_groups(self, n: int) -> float:
        """One wait of up to 0.5 s for up to n groups from the stream (into the start order); returns the seconds
        waited. Raises StopTraining when nothing came and the time limit is reached."""
        self.settle_push(block=False)  # a push that failed ends the wait: no data comes without it
        tw = time.time()
        got = self.stream.get(n, timeout_s=0.5)
        self.order.add(got)
        if not got and not self._time_left():
            raise StopTraining
        return time.time() - tw

    # -- one optimizer step -------------------------------------------------------------------------------------
    def _micro_batch(self, data: StepData, idx: list[int], n_seq: int, n_tok: int, trained: list[bool] | None = None):
        s = [data.samples[i] for i in idx]
        a = [data.advantages[i] for i in idx]
        batch = collate(s, a, n_seq, n_tok, temperature=self.cfg.actor.temperature, trained=trained)
        data.forward_tokens += forward_tokens(s, getattr(self.policy, "share_prompts", False))
        if needs_prox(self.cfg):  # pi_prox: weights before this step (unchanged until the step)
            batch.prox_logprobs = self.policy.forward_logprobs(batch)
        if self.ref_policy is not None and self.cfg.algo.kl_coef > 0:  # the KL term of the loss
            batch.ref_logprobs = self.ref_policy.forward_logprobs(batch)
        return batch

    def _step_advantages(self, data: StepData) -> None:
        """REINFORCE++: the per-token advantages of the step's trained samples, from their base rewards (in
        data.advantages until now), the reference model's KL and the statistics of the whole step."""
        idx = list(data.pending)
        rewards = [float(data.advantages[i]) for i in idx]  # type: ignore[arg-type]  # scalars until here
        advantages, data.kl_reward = per_token_advantages([data.samples[i] for i in idx], rewards, self.cfg,
                                                          self.ref_policy)
        for i, a in zip(idx, advantages, strict=True):
            data.advantages[i] = a

    def _run(self, data: StepData, final: bool, n_seq: int, n_tok: int, stats: list) -> None:
        """Back-propagate the pending samples' full micro-batches (all of them when final)."""
        if final and not data.trained and not data.pending and (data.skipped or data.masked):
            # one sample with nothing trained (gradient 0) so that every parameter has a gradient: the optimizer
            # step is then the same as with every sample trained (AdamW skips parameters without one)
            stand_in = min(data.skipped + data.masked, key=lambda i: len(data.samples[i]))
            stats.append(self.policy.backward(self._micro_batch(data, [stand_in], n_seq, n_tok, [False]),
                                              self.loss_fn))
            return
        budget = self.cfg.trainer.micro_batch_tokens
        lengths = [len(data.samples[i]) for i in data.pending]
        if not final and sum(lengths) < budget:
            return
        bins = first_fit_decreasing(lengths, budget)
        ready = bins if final else bins[:-1]  # keep the last, least full bin open for more samples
        done: set[int] = set()
        for b in ready:
            idx = [data.pending[j] for j in b]
            batch = self._micro_batch(data, idx, n_seq, n_tok)
            stats.append(self.policy.backward(batch, self.loss_fn))
            data.trained += len(idx)
            done.update(idx)
        data.pending = [i for i in data.pending if i not in done]

    def _add_groups(self, data: StepData, groups: list[Group]) -> None:
        rewards = [[s.reward for s in g] for g in groups]
        mode = self.cfg.algo.truncated
        if self.per_step_advantages:  # the sample's reward (less its group's mean), per token once the step is in
            advantages = reinforce_pp.base_rewards(rewards, self.cfg.algo)
        else:
            advantages = adv_mod.compute_advantages(rewards, self.cfg.algo)
        for g, adv in zip(groups, advantages, strict=True):
            for s, a in zip(g, adv, strict=True):
                if not trains(s, mode):
                    data.masked.append(len(data.samples))
                elif a == 0.0 and self.skip_zero_advantage:
                    data.skipped.append(len(data.samples))
                else:
                    data.pending.append(len(data.samples))
                data.samples.append(s)
                data.advantages.append(float(a))
                data.rewards.append(s.reward)
            data.groups += 1

    def step(self) -> dict[str, float]:
        gps = self.cfg.actor.groups_per_step
        n_seq = gps * self.cfg.actor.group_size
        incremental = normalization_of(self.algo) != "tokens" and not self.per_step_advantages
        data = StepData()
        stats: list[dict[str, float]] = []
        t0 = time.time()
        wait_s = self.await_round()
        while data.groups < gps:
            groups = self.order.take(gps - data.groups, self.live_cap())
            if not groups:
                wait_s += self.wait_for_groups(gps)
                continue
            self._add_groups(data, groups)
            if incremental:
                self._run(data, False, n_seq, 0, stats)
        work: CriticWork | None = None
        if self.critic is not None:
            work = gae_step(data, self.cfg, self.critic)
        elif self.per_step_advantages:
            self._step_advantages(data)
        masked = set(data.masked)
        n_tok = count_loss_tokens([s for i, s in enumerate(data.samples) if i not in masked])
        warmup = self.critic is not None and self.policy.version < self.cfg.critic.warmup_steps
        if not warmup:  # a critic warm-up step: no policy gradient, so its optimizer step changes nothing
            self._run(data, True, n_seq, n_tok, stats)
        critic_stats = work.train(self.critic) if work is not None else {}
        tw = time.time()
        self.settle_push(block=True)  # the optimizer writes the weights the previous push may still be reading
        push_wait_s = time.time() - tw
        opt = self.policy.optimizer_step()
        version = self.policy.version
        t_train = time.time() - t0 - wait_s - push_wait_s

        self.samples_trained += len(data.samples)
        self.stream.ack(self.stream.consumed - len(self.order))  # buffered groups are not used yet

        if self.cfg.pipeline.mode != "sync" or version % self.cfg.pipeline.num_grad_steps == 0:
            if self.cfg.actor.gated:  # the servers hold each request until they have its version: publish now
                self.publish(version)
            self.start_push(version)
        step_s = time.time() - t0
        loss = merge_stats(stats) if stats else derive_stats(dict.fromkeys(SUM_KEYS + MAX_KEYS, 0.0))
        record = {
            **{k: loss[k] for k in ("loss", "ratio_mean", "ratio_max", "clip_frac", "mask_frac", "ess", "kl",
                                    "entropy")},
            # lag = version of the weights being trained (before this step) - version that generated the token
            **opt, **lag_stats(data.samples, version - 1), **version_mix(data.samples),
            "group_indices": sorted({int(s.meta["group_index"]) for s in data.samples if "group_index" in s.meta}),
            "task_ids": [t for _, t in sorted({(int(s.meta["group_index"]), s.task_id) for s in data.samples
                                               if "group_index" in s.meta})],  # the prompt of each group index
            "reward_mean": sum(data.rewards) / len(data.rewards),
            "samples": len(data.samples), "samples_total": self.samples_trained,
            **completion_stats(data.samples), "masked_samples": len(data.masked),
            "tokens": n_tok, "micro_batches": len(stats), "trained_samples": data.trained,
            "trainer_tokens": data.forward_tokens,
            "wait_s": wait_s, "train_s": t_train, "push_wait_s": push_wait_s, "step_s": step_s,
            "tokens_per_s": n_tok / max(t_train, 1e-9), "published_version": self.published_version,
            "skipped_groups": len(self.order.skipped),
            "elapsed_s": time.time() - self.started,
        }
        if self.per_step_advantages and self.critic is None:
            record["kl_reward"] = data.kl_reward
        if self.cfg.actor.dynamic_sampling:
            record.update(refill_stats(self.order.pop_passed(), data.samples, gps))
            if record["groups_capped"] and not self._warned_capped:  # once: the records count every step's
                self._warned_capped = True
                self.log.log("warning", step=version, kind="dynamic_sampling_cap", message=(
                    f"{record['groups_capped']} of {gps} groups still had equal rewards on their last try "
                    f"(actor.dynamic_sampling_max_tries={self.cfg.actor.dynamic_sampling_max_tries}) and were "
                    "trained with zero advantage; the task may be too easy or too hard for the model"))
        if work is not None:
            record.update(critic_stats, critic_warmup=warmup)
        self.log.log("train_step", step=version, **record)
        self.warn_truncation(version, record["truncated_frac"])
        return record

    def warn_truncation(self, step: int, truncated_frac: float) -> None:
        msg = self.alarm.update(truncated_frac)
        if msg:
            self.log.log("warning", step=step, kind="truncation", message=msg)

    # -- weights to the servers, in the background ------------------------------------------------------------------
    def publish(self, version: int) -> None:
        """The version the actor's staleness bound counts from (and the trainer's start-order cap)."""
        self.stream.publish_version(version)
        self.published_version = version

    def start_push(self, version: int) -> None:
        """Push the current weights as `version` on a thread (without the version gate, it publishes the version once
        every server has it)."""
        self.settle_push(block=True)

        def target() -> None:
            try:
                push.box["res"] = self.push(version)
                if not self.cfg.actor.gated:
                    self.publish(version)
                push.box["done"] = time.time()
            except BaseException as exc:  # raised in the loop's thread by settle_push
                push.box["err"] = exc

        push = _Push(version, threading.Thread(target=target, name=f"push-bg-v{version}", daemon=True), time.time())
        self._push = push
        push.thread.start()

    def settle_push(self, block: bool) -> None:
        """Collect the push in flight once it is done (or wait for it): log it, or raise the error that ended it."""
        push = self._push
        if push is None or (not block and push.thread.is_alive()):
            return
        push.thread.join()
        self._push = None
        if "err" in push.box:
            raise push.box["err"]
        pauses = list((push.box["res"].get("pause_s") or {}).values())
        self.log.log("weight_push", step=push.version, push_s=push.box["res"].get("seconds"),
                     bytes=push.box["res"].get("bytes"), adapter=bool(push.box["res"].get("adapter")),
                     pause_s=max(pauses) if pauses else None,  # the slowest server's pause
                     done_after_s=push.box["done"] - push.started)  # until every server had it

    # -- weights to the servers, surviving a server that died or restarted ------------------------------------------
    def push(self, version: int, weights: Any = None) -> dict:
        """Push the current weights as `version` to every server (`weights`: what to send instead of the policy's
        named_weights, resent as it is on every attempt: the FSDP2 loop's gathered update). A failed update is
        retried after the weight group is formed again with every server (a restarted one joins it); a server that
        rejects the update itself
        (4xx other than 409) or `pipeline.weight_sync_retries` failures stop the trainer with the servers'
        versions in the message. A server applies an update whole or not at all, so each holds one version."""
        retries = self.cfg.pipeline.weight_sync_retries
        for attempt in range(retries + 1):
            try:
                return self._watched_push(version, weights)
            except WeightSyncError as exc:
                permanent = any(code != "409" for code in re.findall(r"\(HTTP (4\d\d)\)", str(exc)))
                if permanent or attempt == retries:
                    versions = server_versions(self.sync.urls, self.cfg.server.api_key)
                    raise RuntimeError(f"weight update to v{version} failed after {attempt + 1} attempt(s); server "
                                       f"versions now {versions}; last error: {exc}") from exc
                self.log.log("weight_sync_retry", step=version, attempt=attempt + 1, error=str(exc)[:1000])
                try:
                    rejoin_weight_group(self.sync, startup_timeout(self.cfg), self.cfg.server.api_key)
                except Exception as rexc:  # counted as this attempt; the next one tries again
                    self.log.log("weight_sync_retry", step=version, rejoin_error=f"{type(rexc).__name__}: {rexc}")
        raise AssertionError("unreachable")

    def _watched_push(self, version: int, weights: Any = None) -> dict:
        """sync.push in a thread, abandoned when a server's port starts refusing connections: a peer that dies inside
        a broadcast can leave it blocked until the group timeout. The abandoned op only ends in an error (its peer is
        gone); the retry forms a new group."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                named = self.policy.named_weights() if weights is None else weights
                box["res"] = self.sync.push(named, version, self.cfg.pipeline.update_mode,
                                            **adapter_of(self.policy)) or {}
            except BaseException as exc:  # handed to the caller's thread
                box["err"] = exc

        t = threading.Thread(target=target, name=f"push-v{version}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(1.0)
            if t.is_alive() and (gone := [u for u in self.sync.urls if refused(u)]):
                raise WeightSyncError(f"server(s) {gone} went down during the update to v{version}")
        if "err" in box:
            raise box["err"]
        return box["res"]

    # -- checkpoints --------------------------------------------------------------------------------------------
    def checkpoint_state(self) -> CheckpointState:
        a = self.cfg.actor
        return CheckpointState(
            step=self.policy.version, version=self.policy.version, samples_trained=self.samples_trained,
            next_group=self.order.next_index, skipped_groups=list(self.order.skipped),
            dropped_groups=self.order.dropped,
            server_version=self.published_version, elapsed_s=time.time() - self.started,
            groups_per_step=a.groups_per_step, group_size=a.group_size, seed=self.cfg.seed)

    def checkpoint(self, final: bool = False) -> Path:
        name = "final" if final else f"step_{self.policy.version:06d}"
        t0 = time.time()
        path = save_checkpoint(self.run_dir / "checkpoints", name, self.policy, self.checkpoint_state(),
                               self.cfg.pipeline.keep_checkpoints, critic=self.critic)
        self.log.log("checkpoint", step=self.policy.version, path=str(path), next_group=self.order.next_index,
                     samples_total=self.samples_trained, seconds=time.time() - t0)
        return path

    def run(self) -> None:
        if self.resumed is not None:  # the servers get the checkpoint's weights and version before the actor starts
            self.start_push(self.policy.version)
            self.settle_push(block=True)
        self.publish(self.policy.version)  # the servers hold these weights: the actor may start
        every = self.cfg.pipeline.checkpoint_every
        try:
            while not self.done():
                self.step()
                if every and self.policy.version % every == 0:
                    self.checkpoint()
        except StopTraining:
            pass
        self.settle_push(block=True)
        if self.published_version != self.policy.version:  # sync mode mid-round: the servers get the final weights
            self.start_push(self.policy.version)
            self.settle_push(block=True)
            self.publish(self.policy.version)
        self.checkpoint(final=True)
        self.log.log("trainer_done", step=self.policy.version, samples_total=self.samples_trained,
                     elapsed_s=time.time() - self.started)
