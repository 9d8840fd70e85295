"""One rank of the every-loss FSDP2 test (a subprocess with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set).

usage: python fsdp_losses_worker.py POLICY_DIR REF_DIR GROUPS_FILE RUN_DIR OUT_FILE
For each of configs(): a fresh FSDP2 policy from POLICY_DIR takes one optimizer step through the pipeline's own
DistributedTrainerLoop.step (rank 0 reads the groups of GROUPS_FILE from a MemoryStream and sends every rank its
share), with the KL term's reference from REF_DIR built once by make_reference (sharded like the policy). Rank 0
saves every config's step record, gradients, weights after the step, and (REINFORCE++, GAE) every rank's per-token
advantages (float64, as per_token_advantages / gae_advantages returned them) with torch.save. GAE: the critic is an
FSDP2Critic built on every rank (its head set by perturb_head, so the values are not all 0; with trainer.lora it
trains its own adapter and the head); the critic's weights after the step are saved too, and once its checkpoint
is written, read into a fresh critic and compared.
"""

import os
import sys
from pathlib import Path

import msgpack
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from inflight.algo.losses import LOSSES  # noqa: E402
from inflight.config import RunConfig  # noqa: E402
from inflight.config.trainer import LoraConfig, TrainerConfig  # noqa: E402
from inflight.streams.memory import MemoryStream  # noqa: E402
from inflight.streams.serialize import decode_group  # noqa: E402
from inflight.trainer.factory import make_reference, make_trainer  # noqa: E402
from tests.trainer.cpu_collectives import default_group_refuses_cpu_tensors  # noqa: E402

G, GPS = 4, 4  # 4 groups: 2 per rank (a config's `groups` takes the first ones only)
KL = 0.05
LORA = dict(rank=4, alpha=8.0)


def configs() -> list[dict]:
    """Every loss of LOSSES without and with the KL term; then the entropy bonus with decoupled PPO and KL, and
    token normalisation (the step's token count summed over the ranks); then KL on a LoRA policy (the reference is
    the base alone, as on the single trainer)."""
    out: list[dict] = [dict(loss=name, kl_coef=kl) for name in sorted(LOSSES) for kl in (0.0, KL)]
    out.append(dict(loss="decoupled_ppo", kl_coef=KL, entropy_coef=0.01, normalization="tokens"))
    out.append(dict(loss="grpo", kl_coef=KL, lora=True))
    # REINFORCE++ and its group baseline, without and with the KL in the return (the step's statistics summed over
    # the ranks); 3 groups: an uneven share (2 on rank 0, 1 on rank 1), k2 once
    out += [dict(advantage=a, kl_reward_coef=kl) for a in ("reinforce_pp", "reinforce_pp_baseline") for kl in (0.0, KL)]
    out.append(dict(advantage="reinforce_pp_baseline", kl_reward_coef=KL, groups=3))
    out.append(dict(advantage="reinforce_pp", kl_reward_coef=KL, kl_reward_estimator="k2", groups=3))
    # PPO with a critic (GAE): the critic sharded like the policy; once with 2 critic mini-batches on 3 groups (an
    # uneven share whose slices cut across the ranks' shares; the checkpoint round trip there), once a warm-up step
    out.append(dict(advantage="gae", loss="ppo", gamma=0.99, lam=0.95))
    out.append(dict(advantage="gae", loss="ppo", groups=3, critic_mini_batches=2, critic_value_clip=0.2))
    out.append(dict(advantage="gae", loss="ppo", critic_warmup_steps=1))
    # a LoRA critic (its own adapter and the head; beside a LoRA policy) on the uneven share, 2 mini-batches (the 2nd
    # moves the adapter's A: B is no longer 0), its checkpoint round trip
    out.append(dict(advantage="gae", loss="ppo", lora=True, groups=3, critic_mini_batches=2))
    return out


def is_gae(algo: dict) -> bool:
    return algo.get("advantage") == "gae"


def perturb_head(critic) -> None:
    """A value head with weights (the same on both sides: seeded, float64), so that the values, GAE's advantages and
    the body's gradients are not trivially 0 at step 1."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = critic.model
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    head = {"lm_head.weight": 0.05 * torch.randn(1, hidden, generator=gen, dtype=torch.float64),
            "lm_head.bias": torch.tensor([0.1], dtype=torch.float64)}
    set_model_state_dict(model, head, options=StateDictOptions(full_state_dict=True, strict=False))


def needs_ref(cfg: RunConfig) -> bool:
    return cfg.algo.kl_coef > 0 or cfg.algo.kl_reward_coef > 0


def recording_gae(real, seen: dict):
    """`real` (step_advantages.gae_advantages) that keeps each sample's per-token advantages in `seen`, as
    `recording` does."""
    def gae_advantages(samples, *args, **kwargs):
        advantages, work = real(samples, *args, **kwargs)
        seen.update({",".join(map(str, s.prompt_ids + s.completion_ids)): list(a)
                     for s, a in zip(samples, advantages, strict=True)})
        return advantages, work
    return gae_advantages


def recording(real, seen: dict):
    """`real` (step_advantages.per_token_advantages, as a trainer loop module calls it) that first keeps each
    sample's per-token advantages (float64) in `seen`, under its token ids joined by commas."""
    def per_token_advantages(samples, *args, **kwargs):
        advantages, kl = real(samples, *args, **kwargs)
        seen.update({",".join(map(str, s.prompt_ids + s.completion_ids)): list(a)
                     for s, a in zip(samples, advantages, strict=True)})
        return advantages, kl
    return per_token_advantages


def counting(forward, count: list):
    """`forward` (the reference's forward_logprobs) that counts its one-token stand-in batches in count[0]."""
    def forward_logprobs(batch):
        count[0] += batch.seq_lens == [1]
        return forward(batch)
    return forward_logprobs


def run_config(algo: dict, backend: str) -> RunConfig:
    """One optimizer step in sync mode (no push within it) over the GPS groups of the stream."""
    cfg = RunConfig()
    cfg.actor.group_size, cfg.actor.groups_per_step = G, algo.get("groups", GPS)
    cfg.pipeline.mode, cfg.pipeline.num_grad_steps, cfg.pipeline.max_steps = "sync", 1000, 1
    cfg.trainer = TrainerConfig(backend=backend, threads=1, lr=1e-3, max_grad_norm=1e9, micro_batch_tokens=40,
                                lora=LoraConfig(**LORA) if algo.get("lora") else None)
    cfg.algo.is_cap = cfg.algo.behaviour_cap = cfg.algo.aipo_rho = 1.5  # caps that act on some tokens (ratios to 2)
    for k, v in algo.items():
        if k.startswith("critic_"):
            setattr(cfg.critic, k.removeprefix("critic_"), v)
        elif k not in ("lora", "groups"):
            setattr(cfg.algo, k, v)
    return cfg


def use_float64() -> None:
    """FSDP2 trainers built after this hold float64 weights (the single side calls model.double()). In float32 the
    two sum the same gradients in another order (5e-7 of the largest gradient apart), and Adam's first step,
    lr * g / (|g| + eps), magnifies that wherever |g| is near eps (5.5e-5 on one weight at lr 1e-3); float64 leaves
    only what the two implementations do differently."""
    from inflight.trainer import critic_fsdp, fsdp

    real_load, real_meta = fsdp.load_model, fsdp.FSDP2Trainer._meta_model
    real_critic = critic_fsdp.load_critic
    fsdp.load_model = lambda *a, **k: real_load(*a, **k).double()  # rank 0's source of the values
    critic_fsdp.load_critic = lambda *a, **k: real_critic(*a, **k).double()  # the critic's (its head first)
    fsdp.FSDP2Trainer._meta_model = lambda self: real_meta(self).double()  # the shards' dtype  # type: ignore


def capture_grads(policy) -> dict:
    """Have policy.optimizer_step first keep a copy of every gradient, whole (gathered on every rank: collective),
    under the parameter's name, in the dict returned."""
    from inflight.trainer.weight_sync.gather import gathered

    grads: dict = {}
    real = policy.optimizer_step

    def step():
        grads.update({n: gathered(p.grad).clone() for n, p in policy.model.named_parameters() if p.grad is not None})
        return real()

    policy.optimizer_step = step
    return grads


def resume_check(critic, folder: Path, cfg: RunConfig) -> dict:
    """Collective: the critic's checkpoint (rank 0 writes it) read into a fresh FSDP2Critic; the largest difference
    of their weights and optimizer state (gathered whole), and whether scheduler and step count came back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from inflight.trainer.critic_fsdp import FSDP2Critic

    critic.save(folder)
    fresh = FSDP2Critic(critic.model_path, cfg.trainer, cfg.critic)
    fresh.init()
    fresh.load(folder)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    a, b = critic.full_state(), fresh.full_state()
    oa, ob = (get_optimizer_state_dict(c.model, c.optimizer, options=opts).get("state", {}) for c in (critic, fresh))
    if not a:  # only rank 0 gets the gathered tensors
        return {}
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    opt = max((oa[n][k] - ob[n][k]).abs().max().item() for n in oa for k in oa[n] if torch.is_tensor(oa[n][k]))
    return {"weights": worst, "optimizer": opt, "tensors": len(oa), "steps": (critic.steps, fresh.steps),
            "scheduler": critic.scheduler.state_dict() == fresh.scheduler.state_dict()}


def read_groups(path: str) -> list:
    return [decode_group(b) for b in msgpack.unpackb(Path(path).read_bytes())]


def main(policy_dir: str, ref_dir: str, groups_file: str, run_dir: str, out: str) -> None:
    from inflight.report.metrics import MetricsLogger
    from inflight.trainer.critic_fsdp import FSDP2Critic
    from inflight.trainer.loop import fsdp_loop
    from inflight.trainer.loop.fsdp_loop import DistributedTrainerLoop
    from inflight.trainer.loop.step_advantages import gae_advantages, per_token_advantages

    default_group_refuses_cpu_tensors()  # as NCCL would on CUDA: CPU collectives must take the trainer's cpu_group
    use_float64()
    ref = None
    results = []
    stand_ins = [0]  # the reference's forwards of a one-token stand-in batch on this rank (a share done early)
    for i, algo in enumerate(configs()):
        cfg = run_config(algo, "fsdp2")
        policy = make_trainer(policy_dir, cfg.trainer)
        torch.manual_seed(0)  # the adapter's A (rank 0 draws it, as the single-process side does)
        policy.init()
        if ref is None:  # collective, once: every rank builds its shard of the reference
            ref = make_reference(ref_dir, cfg.trainer)
            assert not any(p.requires_grad for p in ref.model.parameters()) and not ref.model.training
            assert not hasattr(ref, "optimizer")
            assert all(hasattr(p, "full_tensor") for p in ref.model.parameters())  # sharded, as the policy
            ref.forward_logprobs = counting(ref.forward_logprobs, stand_ins)
        assert all(p.dtype == torch.float64 for p in policy.model.parameters())
        rank, world = policy.rank, policy.world_size
        stream, log = (MemoryStream(), MetricsLogger(Path(run_dir) / str(i), "trainer")) if rank == 0 else (None, None)
        if stream is not None:
            stream.put(read_groups(groups_file))
        critic = None
        if is_gae(algo):  # collective: every rank builds its shard
            critic = FSDP2Critic(policy_dir, cfg.trainer, cfg.critic)
            torch.manual_seed(1)  # a LoRA critic's adapter A (rank 0 draws it, as the single-process side does)
            critic.init()
            assert all(hasattr(p, "full_tensor") and p.dtype == torch.float64 for p in critic.model.parameters())
            perturb_head(critic)
        loop = DistributedTrainerLoop(cfg, policy, stream, None, log, run_dir, rank=rank, world_size=world,
                                      ref_policy=ref if needs_ref(cfg) else None, critic=critic)
        grads = capture_grads(policy)
        advantages: dict = {}
        fsdp_loop.per_token_advantages = recording(per_token_advantages, advantages)
        fsdp_loop.gae_advantages = recording_gae(gae_advantages, advantages)
        record = loop.step()
        weights = {n: w.clone() for n, w in policy.named_weights()}  # collective
        critic_weights = critic.full_state() if critic is not None else {}  # collective
        resumed = resume_check(critic, Path(run_dir) / f"critic_{i}", cfg) if algo.get("groups") == 3 and critic else {}
        shares: list = [None] * world
        torch.distributed.all_gather_object(shares, (advantages, stand_ins[0]), group=policy.cpu_group)
        stand_ins[0] = 0
        if rank == 0:
            results.append({"algo": algo, "record": {k: v for k, v in record.items() if isinstance(v, float)},
                            "weights": weights, "grads": grads, "shares": [len(a) for a, _ in shares],
                            "critic_weights": critic_weights, "resumed": resumed,
                            "stand_ins": [n for _, n in shares],
                            "advantages": {k: v for a, _ in shares for k, v in a.items()}})
            log.close()
        del loop, policy, critic
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:6])
