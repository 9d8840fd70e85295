"""Entry points of the role processes the launcher starts (multiprocessing "spawn" targets). Each one gets the
resolved RunConfig, the run folder, the server URLs and the stream object, and nothing else: where a role runs is
configuration, what it talks to is the two contracts and the stream."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from inflight.actor import run_actor
from inflight.algo import gae
from inflight.backends import startup_timeout
from inflight.config import RunConfig
from inflight.pipeline.launch_common import wait_healthy
from inflight.process import freeze_startup_objects, retain_freed_memory
from inflight.report.metrics import MetricsLogger
from inflight.trainer.critic_fsdp import make_critic
from inflight.trainer.factory import make_reference, make_trainer
from inflight.trainer.loop.checkpoint import model_folder, restore_critic, restore_trainer
from inflight.trainer.loop.fsdp_loop import DistributedTrainerLoop
from inflight.trainer.loop.trainer_loop import TrainerLoop
from inflight.trainer.weight_sync import make_weight_sync


def _setup(seed: int, threads: int) -> None:
    retain_freed_memory()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if threads > 0:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)


def trainer_main(cfg: RunConfig, run_dir: str, server_urls: list[str], stream: Any,
                 resume_from: str | None = None) -> None:
    """The trainer role: policy + weight sync + TrainerLoop, until a limit (steps, samples, minutes).
    With trainer.backend=fsdp2 this is one rank (RANK / WORLD_SIZE / MASTER_* in the environment); rank 0 alone
    reads the stream, pushes weights and logs. `resume_from`: a checkpoint folder to continue from (weights,
    optimizer, scheduler, RNG, counters; the servers get its weights before the actor starts)."""
    _setup(cfg.seed, cfg.trainer.threads)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    t0 = time.time()
    policy = make_trainer(model_folder(cfg, resume_from), cfg.trainer)
    policy.init()
    resume = None
    if resume_from:
        resume = restore_trainer(policy, resume_from)
    # FSDP2 gathers weights with collectives, even at world 1: its pushes must not overlap the next step's
    # forward (TrainerLoop pushes on a thread meanwhile), so every FSDP2 run takes the distributed loop
    distributed = world > 1 or cfg.trainer.backend == "fsdp2"
    # the reference model (KL in the loss or in the return): the frozen starting weights (cfg.model.path, also on
    # resume; with LoRA the base alone), on the policy's backend: with fsdp2 every rank builds its shard (collective)
    needs_ref = cfg.algo.kl_coef > 0 or cfg.algo.kl_reward_coef > 0
    ref = make_reference(cfg.model.path, cfg.trainer) if needs_ref else None
    critic = None
    if cfg.algo.advantage == gae.ADVANTAGE:  # the value model, from its own path (also on resume), then its state;
        # with fsdp2 every rank builds its shard and reads the checkpoint (collective)
        critic = make_critic(cfg.critic.model_path or cfg.model.path, cfg.trainer, cfg.critic)
        critic.init()
        if resume_from:
            restore_critic(critic, resume_from)
    if distributed and rank > 0:
        freeze_startup_objects()
        DistributedTrainerLoop(cfg, policy, stream, None, None, run_dir, rank=rank, world_size=world,
                               ref_policy=ref, resume=resume, critic=critic).run()
        return
    log = MetricsLogger(run_dir, "trainer", tensorboard=cfg.pipeline.tensorboard, wandb=cfg.pipeline.wandb)
    sync = make_weight_sync(cfg, server_urls)  # trainer.protocol: inflight | vllm | sglang
    wait_healthy(server_urls, [], startup_timeout(cfg), cfg.server.api_key)  # servers may still load
    sync.init_process_group()
    log.log("trainer_ready", step=policy.version, init_s=time.time() - t0, pid=os.getpid(),
            resumed_from=resume_from)
    freeze_startup_objects()
    try:
        if distributed:
            DistributedTrainerLoop(cfg, policy, stream, sync, log, run_dir, rank=0, world_size=world,
                                   ref_policy=ref, resume=resume, critic=critic).run()
        else:
            TrainerLoop(cfg, policy, stream, sync, log, run_dir, ref_policy=ref, resume=resume, critic=critic).run()
    finally:
        sync.close()
        log.close()


def actor_main(cfg: RunConfig, run_dir: str, server_urls: list[str], stream: Any, resume: dict | None = None) -> None:
    """The actor role: rollouts through the servers, rewards, groups into the stream, held-out evaluations.
    `resume`: {"next_group", "skipped", "version"} of the checkpoint the trainer resumes from."""
    _setup(cfg.seed, 1)
    log = MetricsLogger(run_dir, "actor", tensorboard=cfg.pipeline.tensorboard)

    def sink(record: dict) -> None:
        rec = dict(record)
        kind = rec.pop("kind", "actor")
        if kind == "eval" and "pass@1" in rec:
            rec["accuracy"] = rec["pass@1"]
        log.log(kind, step=rec.get("trainer_version"), **{k.replace("actor/", ""): v for k, v in rec.items()})

    try:
        final = run_actor(cfg, server_urls, stream, metrics_sink=sink, resume=resume)
        failures = final.pop("failures", [])
        log.log("actor_done", failures=failures[:20], **{k.replace("actor/", ""): v for k, v in final.items()})
    finally:
        log.close()
