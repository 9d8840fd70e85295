"""The trainer loop over N FSDP2 ranks. Rank 0 alone talks to the stream and the servers: it takes the step's
groups in start order and sends every rank its share (msgpack bytes, the stream's own encoding, never pickle)
over the trainer's gloo group (cpu_group); all ranks then run the collective forward/backward (StepAccumulator keeps their
micro-batch counts equal; decoupled PPO's pi_prox and the KL reference's logprobs are collective forwards before
each backward; REINFORCE++'s and GAE's advantages take the step's statistics summed over the ranks, the critic's
values and its update being collectives over each rank's share, step_advantages.py and trainer/critic_fsdp.py), the
optimizer step, and the weight gather (once per push, on every rank) whose result rank 0 sends to the servers,
with the single trainer's retries (a restarted server rejoins the weight group)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from inflight.algo import advantages as adv_mod
from inflight.algo import reinforce_pp
from inflight.algo.dynamic_sampling import refill_stats
from inflight.algo.losses import MAX_KEYS, SUM_KEYS, derive_stats, lag_stats, merge_stats
from inflight.algo.truncation import trains
from inflight.config import RunConfig
from inflight.contracts import Group
from inflight.trainer.loop.checkpoint import CheckpointState
from inflight.trainer.loop.completions import completion_stats
from inflight.trainer.loop.step_advantages import CriticWork, gae_advantages, per_token_advantages
from inflight.trainer.loop.trainer_loop import StopTraining, TrainerLoop, needs_prox, version_mix
from inflight.streams.serialize import decode_group, encode_group
from inflight.trainer.accumulate import StepAccumulator
from inflight.trainer.packing import count_loss_tokens

WIRE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def broadcast_bytes(blobs: list[bytes] | None, rank: int, group: Any) -> list[bytes]:
    """Rank 0's list of byte strings to every rank (lengths first, then one uint8 buffer). CPU tensors: `group`
    must be a gloo group (the trainer's cpu_group; NCCL, the default group on CUDA, has no CPU tensors)."""
    if rank == 0 and blobs is None:
        raise ValueError("rank 0 sends the byte strings: blobs is None")
    sent = blobs or []
    n = torch.tensor([len(sent) if rank == 0 else 0], dtype=torch.long)
    dist.broadcast(n, 0, group=group)
    lens = torch.tensor([len(b) for b in sent] if rank == 0 else [0] * int(n), dtype=torch.long)
    dist.broadcast(lens, 0, group=group)
    buf = (torch.frombuffer(bytearray(b"".join(sent)), dtype=torch.uint8) if rank == 0 and int(lens.sum())
           else torch.empty(int(lens.sum()), dtype=torch.uint8))
    if buf.numel():
        dist.broadcast(buf, 0, group=group)
    raw, out, pos = buf.numpy().tobytes(), [], 0
    for k in lens.tolist():
        out.append(raw[pos:pos + k])
        pos += k
    return out


def reduce_loss_stats(stats: dict[str, float], group: Any) -> dict[str, float]:
    """The step's loss stats over all ranks (each holds its own share's): sums added, maxima maxed, means derived.
    CPU tensors: `group` is the trainer's gloo cpu_group."""
    sums = torch.tensor([float(stats.get(k, 0.0)) for k in SUM_KEYS], dtype=torch.float64)
    maxes = torch.tensor([float(stats.get(k, 0.0)) for k in MAX_KEYS], dtype=torch.float64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    return derive_stats({**dict(zip(SUM_KEYS, sums.tolist(), strict=True)),
                         **dict(zip(MAX_KEYS, maxes.tolist(), strict=True))})


class DistributedTrainerLoop(TrainerLoop):
    def __init__(self, cfg: RunConfig, policy: Any, stream: Any, sync_client: Any, log: Any, run_dir: str | Path, *,
                 rank: int, world_size: int, ref_policy: Any = None, resume: CheckpointState | None = None,
                 critic: Any = None):
        """`ref_policy`: the KL term's frozen reference (factory.make_reference), `critic`: the value model
        (critic_fsdp.FSDP2Critic), both sharded over the same ranks; every rank passes its own."""
        super().__init__(cfg, policy, stream, sync_client, log, run_dir, ref_policy=ref_policy, resume=resume,
                         critic=critic)
        self.rank, self.world = rank, world_size

    def _collect(self) -> tuple[list, float, bool]:
        """Rank 0: the step's groups in start order, time spent waiting, and whether the run must stop."""
        gps, wait_s = self.cfg.actor.groups_per_step, 0.0
        groups: list[Group] = []
        if self.done():
            return [], 0.0, True
        try:
            wait_s = self.await_round()
            while len(groups) < gps:
                got = self.order.take(gps - len(groups), self.live_cap())
                if got:
                    groups += got
                else:
                    wait_s += self.wait_for_groups(gps)
        except StopTraining:
            return [], wait_s, True
        return groups, wait_s, False

    def step(self) -> dict[str, float]:
        t0 = time.time()
        groups, wait_s, stop = self._collect() if self.rank == 0 else ([], 0.0, False)
        flag = torch.tensor([int(stop)], dtype=torch.long)
        dist.broadcast(flag, 0, group=self.policy.cpu_group)
        if int(flag):
            raise StopTraining
        blobs = broadcast_bytes([encode_group(g) for g in groups] if self.rank == 0 else None, self.rank,
                                self.policy.cpu_group)
        everything = [decode_group(b) for b in blobs]
        mine = everything[self.rank::self.world]
        n_seq = sum(len(g) for g in everything)
        acc = StepAccumulator(self.policy, self.loss_fn, self.cfg.trainer.micro_batch_tokens, n_seq, None,
                              temperature=self.cfg.actor.temperature, merge=merge_stats, prox=needs_prox(self.cfg),
                              ref=self.ref_policy if self.cfg.algo.kl_coef > 0 else None)  # else: KL in the return
        rewards = [[s.reward for s in g] for g in mine]
        if self.per_step_advantages:  # REINFORCE++: base rewards here, per-token advantages once the step is in
            advs: list = reinforce_pp.base_rewards(rewards, self.cfg.algo)
        else:
            advs = adv_mod.compute_advantages(rewards, self.cfg.algo) if mine else []
        # algo.truncated=mask: truncated samples count in their group's baseline and in n_seq, never in the loss
        kept = [(s, a) for g, adv in zip(mine, advs, strict=True) for s, a in zip(g, adv, strict=True)
                if trains(s, self.cfg.algo.truncated)]
        kl_reward = 0.0
        work: CriticWork | None = None  # GAE: what the critic trains on once the policy's step is done
        if self.critic is not None:  # collective: the critic's values of this share, whitened over every rank's
            per_token, work = gae_advantages([s for s, _ in kept], [a for _, a in kept], self.cfg, self.critic,
                                             self.world, self.policy.cpu_group)
            kept = [(s, a) for (s, _), a in zip(kept, per_token, strict=True)]
            work.index, work.n_step = self._step_positions(everything)
        elif self.per_step_advantages:  # collective: the step's statistics over every rank's tokens
            per_token, kl_reward = per_token_advantages([s for s, _ in kept], [a for _, a in kept], self.cfg,
                                                        self.ref_policy, self.world, self.policy.cpu_group)
            kept = [(s, a) for (s, _), a in zip(kept, per_token, strict=True)]
        warmup = self.critic is not None and self.policy.version < self.cfg.critic.warmup_steps
        if not warmup:  # a critic warm-up step: no policy gradient (every rank alike), the optimizer step changes nothing
            acc.add([s for s, _ in kept], [a for _, a in kept])
        stats = acc.finish()  # collective: backward on the rest, then the optimizer step
        loss = reduce_loss_stats(stats, self.policy.cpu_group)
        critic_stats = work.train(self.critic) if work is not None else {}  # collective
        version = self.policy.version
        t_train = time.time() - t0 - wait_s
        samples = [s for g in everything for s in g]
        self.samples_trained += len(samples)
        push_s = 0.0  # synchronous here: every rank takes part in the gather that feeds the push
        if self.cfg.pipeline.mode != "sync" or version % self.cfg.pipeline.num_grad_steps == 0:
            tp = time.time()
            self._send_weights(version)
            if self.rank == 0:
                self.stream.publish_version(version)
            push_s = time.time() - tp
            self.published_version = version
        if self.rank != 0:
            return {}
        self.stream.ack(self.stream.consumed - len(self.order))
        n_tok = count_loss_tokens([s for s in samples if trains(s, self.cfg.algo.truncated)])
        record = {
            **{k: loss[k] for k in ("loss", "ratio_mean", "ratio_max", "clip_frac", "mask_frac", "ess", "kl",
                                    "entropy")},
            "grad_norm": stats.get("grad_norm"), "lr": stats.get("lr"),
            **lag_stats(samples, version - 1), **version_mix(samples),
            "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
            "samples": len(samples), "samples_total": self.samples_trained, "tokens": n_tok, "ranks": self.world,
            **completion_stats(samples),
            "masked_samples": sum(not trains(s, self.cfg.algo.truncated) for s in samples),
            "wait_s": wait_s, "train_s": t_train, "push_wait_s": push_s,
            "step_s": time.time() - t0, "tokens_per_s": n_tok / max(t_train, 1e-9),
            "published_version": self.published_version, "skipped_groups": len(self.order.skipped),
            "elapsed_s": time.time() - self.started,
        }
        if self.per_step_advantages and work is None:
            record["kl_reward"] = kl_reward
        if work is not None:
            record.update(critic_stats, critic_warmup=warmup)
        if self.cfg.actor.dynamic_sampling:
            record.update(refill_stats(self.order.pop_passed(), samples, self.cfg.actor.groups_per_step))
        self.log.log("train_step", step=version, **record)
        self.warn_truncation(version, record["truncated_frac"])
        return record

    def checkpoint(self, final: bool = False):
        """Collective. Rank 0 writes the checkpoint (save_checkpoint calls policy.save, then policy.train_state);
        the other ranks make the same two collective calls: the weights and the optimizer shards are gathered."""
        if self.rank == 0:
            return super().checkpoint(final)
        self.policy.save("")
        self.policy.train_state()
        if self.critic is not None:  # save_checkpoint's third collective
            self.critic.save("")

    def _step_positions(self, everything: list[Group]) -> tuple[list[int], int]:
        """This rank's trained samples' positions among the whole step's (in the single trainer's order: groups as
        taken, samples in their group), and how many the step trains: the critic's mini-batches slice the step."""
        mine, n = [], 0
        for gi, g in enumerate(everything):
            for s in g:
                if trains(s, self.cfg.algo.truncated):
                    if gi % self.world == self.rank:
                        mine.append(n)
                    n += 1
        return mine, n

    def _send_weights(self, version: int) -> None:
        """Collective: every rank gathers the weights once, each shard cast to the servers' dtype first; rank 0
        keeps them packed for the wire (sync.prepare: one copy, built one bucket at a time) and pushes them with the
        loop's retries, which resend that copy and never gather again (a gather on rank 0 alone would wait forever
        for the other ranks). The other ranks drop each tensor as it comes."""
        gathered = self.policy.named_weights(self._wire_dtype())
        if self.rank != 0:
            for _ in gathered:
                pass
            return
        tp = time.time()
        prepare = getattr(self.sync, "prepare", None)
        weights = prepare(gathered) if prepare is not None else list(gathered)
        res = self.push(version, weights) or {}
        del weights
        pauses = list((res.get("pause_s") or {}).values())
        self.log.log("weight_push", step=version, push_s=res.get("seconds"), bytes=res.get("bytes"),
                     adapter=bool(res.get("adapter")),
                     pause_s=max(pauses) if pauses else None, done_after_s=time.time() - tp)

    def _wire_dtype(self) -> torch.dtype | None:
        """Collective: the dtype the servers take (rank 0's weight client knows it; None: the weights' own), the
        same on every rank, since the gather casts each rank's shard."""
        code = torch.tensor([WIRE_DTYPES.index(getattr(self.sync, "dtype", None)) if self.rank == 0 else 0])
        dist.broadcast(code, 0, group=self.policy.cpu_group)
        return WIRE_DTYPES[int(code)]

    def done(self) -> bool:
        return self.rank == 0 and super().done()

    def run(self) -> None:
        if self.resumed is not None:  # the servers get the checkpoint's weights and version before the actor starts
            self._send_weights(self.policy.version)
            self.published_version = self.policy.version
        if self.rank == 0:
            self.stream.publish_version(self.published_version)
        try:
            while True:
                self.step()
                every = self.cfg.pipeline.checkpoint_every
                if every and self.policy.version % every == 0:
                    self.checkpoint()
        except StopTraining:
            pass
        if self.published_version != self.policy.version:  # sync mode mid-round
            self._send_weights(self.policy.version)
            if self.rank == 0:
                self.stream.publish_version(self.policy.version)
        self.checkpoint(final=True)
        if self.rank == 0:
            self.log.log("trainer_done", step=self.policy.version, samples_total=self.samples_trained,
                         elapsed_s=time.time() - self.started)
