"""Each new algorithm trains the tiny model a step on the single-device trainer (float64): the loss the trainer
reports and the gradient it accumulates in the weights equal the papers' references of tests/algo (taken through a
plain HF forward, one sample at a time), and the optimizer step moves the weights. REINFORCE++ runs through the
trainer loop: its micro-batches carry the paper's per-token advantages, with the reference model's KL."""

from __future__ import annotations

import math
import random

import pytest
import torch

from inflight.algo import AlgoConfig, make_loss
from inflight.config import RunConfig
from inflight.config.trainer import TrainerConfig
from inflight.contracts import Sample
from inflight.report.metrics import MetricsLogger
from inflight.streams.memory import MemoryStream
from inflight.trainer.loop.trainer_loop import TrainerLoop
from inflight.trainer.packing import count_loss_tokens, pack_samples
from inflight.trainer.single import SingleDeviceTrainer
from tests.algo.test_algo_new_losses import cispo_reference, dr_grpo_reference, gspo_reference, mis_reference
from tests.algo.test_algo_reinforce_pp import reference as reinforce_pp_reference
from tests.trainer.helpers import random_samples

torch.set_num_threads(1)


def float64_trainer(model_dir) -> SingleDeviceTrainer:
    t = SingleDeviceTrainer(str(model_dir), TrainerConfig(threads=1, lr=1e-2, max_grad_norm=1e9))
    t.init()
    t.model.double()  # in place: the optimizer keeps the same parameters
    return t


def plain_logprobs(model, batch) -> torch.Tensor:
    """[T] logprobs with grad from a plain HF forward of each sample alone (0 at each sample's first token)."""
    out, start = [], 0
    for n in batch.seq_lens:
        ids = batch.input_ids[start : start + n]
        logits = model(input_ids=ids[None]).logits[0]
        lp = torch.log_softmax(logits[:-1].double(), -1).gather(-1, ids[1:, None])[:, 0]
        out += [torch.zeros(1, dtype=torch.float64), lp]
        start += n
    return torch.cat(out)


def reference(cfg: AlgoConfig, batch, logp):
    if cfg.loss in ("gspo", "gspo_token"):
        loss, grad, _ = gspo_reference(cfg, batch, logp, "sequence_length", cfg.loss == "gspo_token")
        return loss, grad
    if cfg.loss == "cispo":
        return cispo_reference(cfg, batch, logp, "tokens")
    if cfg.normalization == "constant":
        return dr_grpo_reference(cfg, batch, logp)
    return mis_reference(cfg, batch, logp)[:2]


CASES = [
    AlgoConfig(loss="gspo"),  # the paper's clip range: μ is set within ~1e-3 of π below, so some samples clip
    AlgoConfig(loss="gspo_token"),
    AlgoConfig(loss="cispo", cispo_clip_high=0.002),  # a tight bound, so that some weights are clipped
    AlgoConfig(loss="ppo", normalization="constant", norm_constant=16.0),  # Dr. GRPO
    AlgoConfig(is_mask="geometric", is_mask_low=0.999, is_mask_high=1.001),  # grpo with masked IS
]


@pytest.mark.parametrize("cfg", CASES, ids=["gspo", "gspo_token", "cispo", "dr_grpo", "grpo_mis"])
def test_one_step_matches_the_reference(tiny_model_dir, cfg):
    t = float64_trainer(tiny_model_dir)
    samples = random_samples(8, t.model.config.vocab_size, seed=21)
    adv = [1.0, -0.5, 0.25, -1.0, 0.75, 2.0, -0.3, 0.6]
    (batch,) = pack_samples(samples, adv, 10_000, len(samples), count_loss_tokens(samples))
    batch.advantages = batch.advantages.double()
    pi = t.forward_logprobs(batch).double()
    g = torch.Generator().manual_seed(3)  # μ near π: the sequence ratios land on both sides of the clip
    batch.behaviour_logprobs = (pi + 2e-3 * torch.randn(len(pi), generator=g, dtype=torch.float64)) * batch.loss_mask
    ref_loss, ref_grad = reference(cfg, batch, pi)
    assert any(x != 0 for x in ref_grad)

    t.optimizer.zero_grad(set_to_none=True)
    stats = t.backward(batch, make_loss(cfg))
    assert stats["loss"] == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    if cfg.normalization != "constant":  # both branches reached: some sequences (tokens) clipped or masked, not all
        assert 0 < stats["clip_frac"] + stats["mask_frac"] < 1
    got = {n: p.grad.detach().clone() for n, p in t.model.named_parameters()}
    params = [p for _, p in t.model.named_parameters()]
    lp = plain_logprobs(t.model, batch)
    want = torch.autograd.grad((torch.tensor(ref_grad, dtype=torch.float64) * lp).sum(), params, allow_unused=True)
    scale = max(float(w.abs().max()) for w in want if w is not None)
    assert scale > 1e-6
    for (n, _), w in zip(t.model.named_parameters(), want, strict=True):
        w = torch.zeros_like(got[n]) if w is None else w
        assert float((got[n] - w).abs().max()) <= 1e-9 * scale, n

    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.optimizer_step()
    assert t.version == 1
    assert max(float((p.detach() - before[n]).abs().max()) for n, p in t.model.named_parameters()) > 1e-4


def test_reinforce_pp_through_the_trainer_loop(tiny_model_dir, tmp_path):
    G, GPS, beta = 4, 2, 0.1
    cfg = RunConfig()
    cfg.actor.group_size, cfg.actor.groups_per_step = G, GPS
    cfg.pipeline.mode, cfg.pipeline.num_grad_steps, cfg.pipeline.max_steps = "sync", 1000, 1
    cfg.algo.advantage, cfg.algo.kl_reward_coef = "reinforce_pp_baseline", beta
    cfg.algo.loss, cfg.algo.is_cap = "grpo", 0.0  # REINFORCE on the advantages: ∂L/∂log π_t = −A_t / N_seq
    policy, ref = float64_trainer(tiny_model_dir), float64_trainer(tiny_model_dir)
    loop = TrainerLoop(cfg, policy, MemoryStream(), None, MetricsLogger(tmp_path, "trainer"), tmp_path,
                       ref_policy=ref)
    assert not loop.skip_zero_advantage
    rng = random.Random(5)
    groups = []
    for j, rewards in enumerate([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]):  # the second group: no own signal
        prompt = [rng.randrange(4, 60) for _ in range(5)]
        group = []
        for r in rewards:
            n = rng.randint(2, 9)
            group.append(Sample(group_id=f"g{j}", prompt_ids=prompt, completion_ids=[rng.randrange(4, 60)
                                for _ in range(n)], logprobs=[-rng.uniform(0.5, 3.0) for _ in range(n)],
                                versions=[0] * n, reward=r, meta={"group_index": j}))
        groups.append(group)
    samples = [s for g in groups for s in g]
    with torch.no_grad():  # the reference model's logprobs of each completion, by a plain forward
        ref_lp = []
        for s in samples:
            ids = torch.tensor(s.prompt_ids + s.completion_ids)
            logits = ref.model(input_ids=ids[None]).logits[0].double()
            ref_lp.append(torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[len(s.prompt_ids) - 1:, 0]
                          .tolist())
    want = reinforce_pp_reference([[s.reward for s in g] for g in groups], [s.logprobs for s in samples], ref_lp,
                                  [[True] * len(s.completion_ids) for s in samples], beta, "k1", True, 1e-6)
    want_by_ids = {tuple(s.prompt_ids + s.completion_ids): w for s, w in zip(samples, want, strict=True)}

    seen: dict[tuple, list[float]] = {}
    backward = policy.backward

    def recording(batch, loss_fn):
        start = 0
        for n in batch.seq_lens:
            ids = tuple(batch.input_ids[start : start + n].tolist())
            seen[ids] = batch.advantages[start : start + n].tolist()
            start += n
        return backward(batch, loss_fn)

    policy.backward = recording
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    loop.stream.put(groups)
    record = loop.step()
    assert record["trained_samples"] == G * GPS and set(seen) == set(want_by_ids)
    for ids, adv in seen.items():
        p = len(samples[0].prompt_ids)
        assert adv[:p] == [0.0] * p
        assert adv[p:] == pytest.approx(want_by_ids[ids], rel=1e-6, abs=1e-6)  # the batch holds float32
    flat = [x for w in want for x in w]
    assert abs(sum(flat)) < 1e-9 and len(set(flat)) > len(samples)  # KL: advantages differ within samples
    kl = [m - r for s, lr in zip(samples, ref_lp, strict=True) for m, r in zip(s.logprobs, lr, strict=True)]
    assert record["kl_reward"] == pytest.approx(sum(kl) / len(kl), rel=1e-9)  # eq. 9's estimate, logged per step
    assert math.isfinite(record["loss"])
    assert max(float((p.detach() - before[n]).abs().max()) for n, p in policy.model.named_parameters()) > 1e-4
