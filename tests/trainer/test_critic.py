"""The critic of PPO with GAE (inflight/trainer/critic.py) on the tiny model: its packed values and their gradients
equal a plain per-sample forward of the body and the head; training on fixed returns lowers the value loss; a
checkpoint holds the critic and a resume restores its weights and optimizer exactly."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from inflight.algo.gae import clipped_value_loss
from inflight.config.critic import CriticConfig
from inflight.config.trainer import LoraConfig, TrainerConfig
from inflight.trainer.critic import Critic, spread
from inflight.trainer.loop import checkpoint as ckpt
from inflight.trainer.loop.step_advantages import trained_tokens
from inflight.trainer.packing import collate, count_loss_tokens
from inflight.trainer.single import SingleDeviceTrainer
from tests.trainer.helpers import random_samples

torch.set_num_threads(1)


def make_critic(path, lora: LoraConfig | None = None, **kw) -> Critic:
    torch.manual_seed(0)  # a LoRA adapter's init draws from the global RNG: the same critic whatever ran before
    c = Critic(str(path), TrainerConfig(lr=1e-3, threads=1, micro_batch_tokens=64, lora=lora),
               CriticConfig(lr=kw.pop("lr", 1e-2), **kw))
    c.init()
    return c


def returns_for(samples, seed: int = 0) -> list[list[float]]:
    """A fixed target per sample (its 'reward'), on every completion token."""
    rng = random.Random(seed)
    return [[float(rng.random() < 0.5)] * len(s.completion_ids) for s in samples]


def reference_values(critic: Critic, samples) -> list[torch.Tensor]:
    """Per sample, unpacked: the body's last hidden states, the head, V of completion token j = output at the token
    before it (0 for a sample's first token)."""
    model = critic.model
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        v = model.get_output_embeddings()(hidden)[:, 0]
        p = len(s.prompt_ids)
        out.append(torch.stack([v[p + j - 1] if p + j > 0 else v.new_zeros(()) for j in range(len(s.completion_ids))]))
    return out


def test_packed_values_and_gradients_match_a_plain_forward(tiny_model_dir):
    critic = make_critic(tiny_model_dir)
    torch.nn.init.normal_(critic.model.get_output_embeddings().weight, std=0.3)  # a head that passes gradients on
    samples = random_samples(6, vocab=40, seed=1)
    for s in samples[2:4]:  # a group's shared prompt runs once per micro-batch (prefix.py)
        s.prompt_ids = [5, 6, 7, 8]
    rets = returns_for(samples)
    old = [[0.1 * k] * len(s.completion_ids) for k, s in enumerate(samples)]
    n_tok = count_loss_tokens(samples)

    got = critic.values(samples)
    with torch.no_grad():
        ref = reference_values(critic, samples)
    for g, r, s in zip(got, ref, samples, strict=True):
        m = trained_tokens(s)
        assert [x for x, on in zip(g, m, strict=True) if on] == pytest.approx(
            [float(x) for x, on in zip(r, m, strict=True) if on], abs=1e-5)

    critic.model.train()
    batch = collate(samples, [list(r) for r in rets], 1, 1, with_versions=False)
    per_tok, _ = clipped_value_loss(critic._values(batch), spread(samples, old), batch.advantages, 0.2)
    (torch.where(batch.loss_mask > 0, per_tok, torch.zeros_like(per_tok)).sum() / n_tok).backward()
    packed = {n: p.grad.clone() for n, p in critic.model.named_parameters() if p.grad is not None}
    critic.optimizer.zero_grad(set_to_none=True)

    total = torch.zeros(())
    for s, v, r, o in zip(samples, reference_values(critic, samples), rets, old, strict=True):
        m = torch.tensor(trained_tokens(s))
        loss, _ = clipped_value_loss(v, torch.tensor(o), torch.tensor(r), 0.2)
        total = total + torch.where(m, loss, torch.zeros_like(loss)).sum()
    (total / n_tok).backward()
    plain = {n: p.grad for n, p in critic.model.named_parameters() if p.grad is not None}
    assert packed.keys() == plain.keys() and len(packed) == len(list(critic.model.parameters()))
    for n in packed:
        assert torch.allclose(packed[n], plain[n], rtol=1e-4, atol=1e-6), n
    assert any(float(g.abs().max()) > 0 for n, g in packed.items() if "layers" in n)  # the body learns too


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=4, alpha=8.0)], ids=["full", "lora"])
def test_training_moves_values_toward_the_returns(tiny_model_dir, lora):
    critic = make_critic(tiny_model_dir, lora=lora, mini_batches=2)
    if lora is not None:  # its own adapter and the head train; the base stays
        trained = [n for n, p in critic.model.named_parameters() if p.requires_grad]
        assert all(".lora_" in n or n.startswith("lm_head") for n in trained) and "lm_head.bias" in trained
    samples = random_samples(8, vocab=40, seed=2)
    rets = returns_for(samples, seed=3)
    masks = [trained_tokens(s) for s in samples]

    def gap(values):
        d = [abs(v - r) for vs, rs, m in zip(values, rets, masks, strict=True)
             for v, r, on in zip(vs, rs, m, strict=True) if on]
        return sum(d) / len(d)

    first = critic.values(samples)
    assert all(v == 0.0 for row in first for v in row)  # the head starts at 0
    losses, gaps = [], [gap(first)]
    for _ in range(6):
        old = critic.values(samples)
        stats = critic.train(samples, old, rets)
        losses.append(stats["value_loss"])
        gaps.append(gap(critic.values(samples)))
    assert gaps[1] < gaps[0]  # one step already moves the values toward the returns
    assert losses[-1] < 0.5 * losses[0] and gaps[-1] < gaps[0]
    assert stats["critic_lr"] == pytest.approx(1e-2) and critic.steps == 6
    assert 0.0 <= stats["value_clip_frac"] <= 1.0


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=4, alpha=8.0)], ids=["full", "lora"])
def test_checkpoint_holds_the_critic_and_resume_restores_it_exactly(tiny_model_dir, tmp_path, lora):
    samples = random_samples(8, vocab=40, seed=4)
    rets = returns_for(samples, seed=5)
    a = make_critic(tiny_model_dir, lora=lora, mini_batches=2)
    for _ in range(2):
        a.train(samples, a.values(samples), rets)
    policy = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(threads=1))
    policy.init()
    state = ckpt.CheckpointState(step=2, version=2, samples_trained=16, next_group=4, groups_per_step=2,
                                 group_size=4)
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", "step_000002", policy, state, critic=a)
    assert (path / "critic" / "critic.safetensors").is_file() and (path / "critic" / "train_state.pt").is_file()

    b = make_critic(tiny_model_dir, lora=lora, mini_batches=2)
    ckpt.restore_critic(b, path)
    wa, wb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for k in sa["state"]:
        for name, t in sa["state"][k].items():
            assert torch.equal(t, sb["state"][k][name]), (k, name)
    assert b.scheduler.state_dict() == a.scheduler.state_dict() and b.steps == a.steps == 2

    for c in (a, b):  # the same next step from both
        c.train(samples, c.values(samples), rets)
    # the same step from bit-equal states; a PEFT model built anew may take another kernel path (ulps, ~1e-9)
    after_b = dict(b.model.named_parameters())
    assert all(torch.allclose(p, after_b[n], rtol=0, atol=1e-7) for n, p in a.model.named_parameters())

    fresh = make_critic(tiny_model_dir, lora=lora, mini_batches=2)  # without the restore the step differs (the test can fail)
    fresh.train(samples, fresh.values(samples), rets)
    assert any(not torch.equal(p, dict(fresh.model.named_parameters())[n]) for n, p in a.model.named_parameters())

    if lora is not None:  # the adapter and the head only: the base comes from the model path
        saved = set(load_file(str(path / "critic" / "critic.safetensors")))
        assert saved == set(a.trained_tensors()) and len(saved) < len(wa)
    else:
        with pytest.raises(ValueError, match="does not fit"):  # a full critic's tensors into a LoRA critic
            ckpt.restore_critic(make_critic(tiny_model_dir, lora=LoraConfig(rank=4, alpha=8.0)), path)
    bare = ckpt.save_checkpoint(tmp_path / "checkpoints", "step_000003", policy, state)
    with pytest.raises(ValueError, match="holds no critic"):
        ckpt.restore_critic(b, bare)


def test_trainer_loop_feeds_gae_of_the_critics_values_to_the_policy(tiny_model_dir, tmp_path):
    """A warm-up step trains the critic alone; the next step's policy gets GAE of the critic's values as they were
    before that step, whitened over the step (gae.step_advantages on the same samples)."""
    from inflight.algo import gae
    from inflight.config import RunConfig
    from inflight.report.metrics import MetricsLogger
    from inflight.streams.memory import MemoryStream
    from inflight.trainer.loop.trainer_loop import TrainerLoop
    from tests.pipeline.test_trainer_loop import GPS, STEPS, G, groups

    cfg = RunConfig()
    cfg.actor.group_size, cfg.actor.groups_per_step = G, GPS
    cfg.pipeline.mode, cfg.pipeline.num_grad_steps, cfg.pipeline.max_steps = "sync", 1000, 2
    cfg.algo.advantage, cfg.algo.loss, cfg.algo.lam = "gae", "ppo", 0.95
    cfg.critic.warmup_steps = 1
    policy = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(threads=1, lr=1e-2, micro_batch_tokens=40))
    policy.init()
    critic = make_critic(tiny_model_dir)
    loop = TrainerLoop(cfg, policy, MemoryStream(), None, MetricsLogger(tmp_path, "trainer"), tmp_path, critic=critic)
    for step in (1, 2):
        loop.stream.put(groups(step, STEPS[step - 1], random.Random(step)))

    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    first = loop.step()
    assert first["critic_warmup"] and first["trained_samples"] == 0 and policy.version == 1
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())  # the policy kept its weights
    assert critic.steps == 1 and first["value_mean"] == 0.0 and first["value_loss"] > 0

    samples = [s for g in groups(2, STEPS[1], random.Random(2)) for s in g]
    values = critic.values(samples)
    masks = [trained_tokens(s) for s in samples]
    want, _ = gae.step_advantages([s.reward for s in samples], values, masks, cfg.algo)
    seen: list[float] = []
    backward = policy.backward

    def spy(batch, loss_fn):
        seen.extend(batch.advantages[batch.loss_mask > 0].tolist())
        return backward(batch, loss_fn)

    policy.backward = spy  # type: ignore[method-assign]
    second = loop.step()
    assert not second["critic_warmup"] and second["trained_samples"] == len(samples)
    flat = [a for row, m in zip(want, masks, strict=True) for a, on in zip(row, m, strict=True) if on]
    assert sorted(seen) == pytest.approx(sorted(flat), abs=1e-5)
    mean_v = [v for row, m in zip(values, masks, strict=True) for v, on in zip(row, m, strict=True) if on]
    assert second["value_mean"] == pytest.approx(sum(mean_v) / len(mean_v), abs=1e-9)
    assert any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters())
