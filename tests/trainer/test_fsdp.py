"""FSDP2 on CPU with 2 gloo processes gives the same 3 optimizer steps as the single-process trainer, on a model with
tied embeddings (the untied path runs in the FSDP2 resume tests): the shared tensor is sharded once, named once in
named_weights() (the contract's canonical name), and save() writes a folder that loads tied."""

from pathlib import Path

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.trainer.packing import pack_samples
from inflight.trainer.single import SingleDeviceTrainer

from .cpu_collectives import run_ranks
from .fsdp_worker import BUDGET, CFG, step_samples
from .helpers import ReinforceLoss

WORKER = Path(__file__).with_name("fsdp_worker.py")
LOSSES_WORKER = Path(__file__).with_name("fsdp_losses_worker.py")


def _single_steps(model_dir, got, cfg, loss_fn):
    """The single-process trainer on all samples of each step; its stats checked against the ranks'."""
    from inflight.trainer.packing import count_loss_tokens

    torch.set_num_threads(1)
    torch.manual_seed(0)
    single = SingleDeviceTrainer(str(model_dir), cfg)
    single.init()
    initial = {n: w.clone() for n, w in single.named_weights()}
    vocab = single.model.config.vocab_size
    for step in range(3):
        samples, adv = step_samples(step, vocab)
        for mb in pack_samples(samples, adv, BUDGET, len(samples), count_loss_tokens(samples)):
            single.backward(mb, loss_fn)
        s = single.optimizer_step()
        assert got["stats"][step]["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-4)
        assert got["stats"][step]["lr"] == pytest.approx(s["lr"])
    return single, initial


@pytest.mark.slow  # ~40 s: two processes load the model and train
def test_fsdp2_two_ranks_equal_single(tied_model_dir, tmp_path):
    tiny_model_dir = tied_model_dir
    out = tmp_path / "rank0.pt"
    run_ranks(WORKER, [tiny_model_dir, out])
    got = torch.load(out, weights_only=True)
    assert got["version"] == 3

    single, initial = _single_steps(tiny_model_dir, got, TrainerConfig(**CFG),
                                    ReinforceLoss(needs_entropy=True, entropy_coef=0.01))
    ref = dict(single.named_weights())
    assert list(got["weights"]) == list(ref)
    moved = 0
    for n in ref:
        torch.testing.assert_close(got["weights"][n], ref[n], atol=2e-5, rtol=1e-4)
        moved += int(not torch.equal(ref[n], initial[n]))
    assert moved >= len(ref) - 1
    assert "lm_head.weight" not in ref
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out.with_suffix(".saved"), dtype=torch.float32)
    assert saved.lm_head.weight is saved.model.embed_tokens.weight
    for n, p in saved.named_parameters():
        torch.testing.assert_close(p.detach(), got["weights"][n])


@pytest.mark.slow  # ~30 s: two processes train a rank-4 adapter
def test_fsdp2_lora_two_ranks_equal_single(tiny_model_dir, tmp_path):
    """A LoRA adapter on FSDP2 (frozen base sharded with trainable adapter): same 3 steps as one process, only the
    adapter trained, saved in PEFT's format and loaded back exactly (in the worker)."""
    from inflight.config.trainer import LoraConfig

    from .fsdp_worker import LORA

    out = tmp_path / "rank0.pt"
    run_ranks(WORKER, [tiny_model_dir, out, "lora"])
    got = torch.load(out, weights_only=True)
    assert got["version"] == 3
    single, initial = _single_steps(tiny_model_dir, got, TrainerConfig(**CFG, lora=LoraConfig(**LORA)),
                                    ReinforceLoss(needs_entropy=True, entropy_coef=0.01))
    ref = dict(single.named_weights())
    assert list(got["weights"]) == list(ref) and all(n.endswith((".lora_A", ".lora_B")) for n in ref)
    for n in ref:
        torch.testing.assert_close(got["weights"][n], ref[n], atol=2e-5, rtol=1e-4)
    assert all(not torch.equal(ref[n], initial[n]) for n in ref if n.endswith(".lora_B"))
    from inflight.trainer.lora import read_adapter

    saved = read_adapter(out.with_suffix(".saved"))
    assert len(saved) == len(ref)


def _perturbed(model_dir: Path, out: Path) -> Path:
    """model_dir's weights plus noise: a policy that differs from its reference (the KL term then has a gradient at
    step 1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def _groups(policy_dir: Path) -> list:
    """GPS groups of G samples (one prompt each; mixed rewards and one all-equal group), behaviour logprobs the
    policy's own plus noise (ratios near 1: every loss's clip and cap act on some tokens, not on all), versions
    lagging by 0-2."""
    import random

    from transformers import AutoModelForCausalLM

    from inflight.contracts import Sample

    from .fsdp_losses_worker import GPS, G

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    rng, rewards = random.Random(3), [[1, 0, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 0]]
    out = []
    for j in range(GPS):
        prompt = [rng.randrange(4, 60) for _ in range(rng.randint(2, 6))]
        group = []
        for r in rewards[j][:G]:
            completion = [rng.randrange(4, 60) for _ in range(rng.randint(2, 12))]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + completion])).logits[0].float()
            lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(completion)[:, None])
            group.append(Sample(group_id=f"g{j}", prompt_ids=prompt, completion_ids=completion,
                                logprobs=[float(x) + rng.gauss(0.0, 0.3) for x in lp[:, 0]],
                                versions=[rng.randint(0, 2)] * len(completion), reward=float(r),
                                meta={"group_index": j}))
        out.append(group)
    return out


@pytest.mark.slow  # ~45 s: two processes take one step per config (one start for all), one process the same
def test_fsdp2_every_loss_equals_single(tiny_model_dir, tmp_path, monkeypatch):
    """Every loss of LOSSES, without and with the KL term (the reference sharded like the policy), the entropy bonus
    once, KL on a LoRA policy, REINFORCE++ and its baseline variant without and with the KL in the return (twice on
    3 groups: an uneven share, the rank with less work running stand-in reference forwards): one step of the
    pipeline's FSDP2 loop at 2 gloo ranks equals one step of the single trainer's loop on the same groups: loss, KL,
    grad norm and the weights after the step within 1e-5, every gradient within 1e-6 of the largest, REINFORCE++'s
    per-token advantages (float64) and mean KL within 1e-9. In float64 (the worker's use_float64; measured: loss
    1e-15, grad norm 7.5e-8, gradients 1e-7, weights 1.7e-6: the float32 upcast inside HF's RMSNorm, then Adam's
    first step; advantages 2.2e-16, KL in the return 3e-17). PPO with a critic (GAE; the critic sharded like the policy,
    its head seeded so values are not 0): the policy as above, GAE's per-token advantages within 1e-9, the critic's
    value loss, grad norm, explained variance and weights after its update within 1e-5, on 4 groups, on 3 (an uneven
    share, 2 critic mini-batches that cut across the ranks' shares; its checkpoint read back into a fresh FSDP2
    critic exactly), on a warm-up step (the policy unchanged on both sides), and as a LoRA critic (its own adapter and
    the head, sharded like the LoRA policy: uneven share, 2 mini-batches, the checkpoint round trip). Measured: GAE
    advantages 6.7e-16, value loss 2.3e-9, critic grad norm 3.6e-8, critic weights 8.8e-7 (the LoRA critic: 0,
    2.1e-9, 4.2e-9)."""
    import msgpack

    from inflight.report.metrics import MetricsLogger
    from inflight.streams.memory import MemoryStream
    from inflight.streams.serialize import encode_group
    from inflight.trainer.critic import Critic
    from inflight.trainer.factory import make_reference, make_trainer
    from inflight.trainer.loop import step_advantages, trainer_loop
    from inflight.trainer.loop.step_advantages import gae_advantages, per_token_advantages
    from inflight.trainer.loop.trainer_loop import TrainerLoop

    from .fsdp_losses_worker import (
        capture_grads,
        configs,
        is_gae,
        needs_ref,
        perturb_head,
        recording,
        recording_gae,
        run_config,
    )

    policy_dir = _perturbed(tiny_model_dir, tmp_path / "policy")
    groups = _groups(policy_dir)
    (tmp_path / "groups.msgpack").write_bytes(msgpack.packb([encode_group(g) for g in groups]))
    out = tmp_path / "rank0.pt"
    run_ranks(LOSSES_WORKER, [policy_dir, tiny_model_dir, tmp_path / "groups.msgpack", tmp_path / "fsdp", out],
              timeout=300)
    got = torch.load(out, weights_only=True)
    assert [r["algo"] for r in got] == configs()

    torch.set_num_threads(1)
    ref = make_reference(str(tiny_model_dir), run_config({}, "single").trainer)
    ref.model.double()  # as the worker's use_float64
    worst = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0, "weights": 0.0, "grads_rel": 0.0,
             "kl_reward": 0.0, "advantages": 0.0, "value_loss": 0.0, "critic_grad_norm": 0.0, "critic_weights": 0.0}
    for i, (algo, fsdp) in enumerate(zip(configs(), got, strict=True)):
        cfg = run_config(algo, "single")
        policy = make_trainer(str(policy_dir), cfg.trainer)
        torch.manual_seed(0)  # the adapter's A, as rank 0 drew it
        policy.init()
        policy.model.double()  # in place: the optimizer keeps the same parameters
        before = {n: w.clone() for n, w in policy.named_weights()}
        critic = None
        if is_gae(algo):
            critic = Critic(str(policy_dir), cfg.trainer, cfg.critic)
            torch.manual_seed(1)  # the LoRA critic's adapter A, as rank 0 drew it
            critic.init()
            critic.model.double()  # in place, as the policy
            perturb_head(critic)
            critic_before = {n: t.detach().clone() for n, t in critic.trained_tensors().items()}
        loop = TrainerLoop(cfg, policy, MemoryStream(), None, MetricsLogger(tmp_path / "single" / str(i), "trainer"),
                           tmp_path / "single", ref_policy=ref if needs_ref(cfg) else None, critic=critic)
        loop.stream.put(groups)
        grads = capture_grads(policy)
        advantages: dict = {}
        monkeypatch.setattr(trainer_loop, "per_token_advantages", recording(per_token_advantages, advantages))
        monkeypatch.setattr(step_advantages, "gae_advantages", recording_gae(gae_advantages, advantages))
        rec = loop.step()
        # REINFORCE++: every sample's per-token advantages as the single trainer's, though each rank normalised
        # only its share (with the step's statistics summed over the ranks)
        assert set(fsdp["advantages"]) == set(advantages), algo
        if advantages:
            assert sorted(fsdp["shares"]) == ([4, 8] if algo.get("groups") == 3 else [8, 8]), algo
            if algo.get("groups") == 3 and not critic:  # the rank with less work ran stand-in reference forwards
                assert fsdp["stand_ins"][0] == 0 and fsdp["stand_ins"][1] > 0, fsdp["stand_ins"]
            for k, a in advantages.items():
                diff = max(abs(x - y) for x, y in zip(fsdp["advantages"][k], a, strict=True))
                worst["advantages"] = max(worst["advantages"], diff)
                assert diff <= 1e-9, (algo, diff)
            assert max(abs(x) for a in advantages.values() for x in a) > 0.1, algo  # not all zero
        if critic is not None:
            for k in ("value_loss", "critic_grad_norm", "explained_variance", "value_mean", "returns_mean",
                      "value_clip_frac"):
                worst[k] = max(worst.get(k, 0.0), abs(fsdp["record"][k] - rec[k]))
                assert fsdp["record"][k] == pytest.approx(rec[k], abs=1e-5), (algo, k)
            assert rec["value_loss"] > 1e-3 and rec["critic_warmup"] == (cfg.critic.warmup_steps > 0), algo
            c_after = {n: t.detach() for n, t in critic.trained_tensors().items()}
            assert list(fsdp["critic_weights"]) == list(c_after)
            for n, w in c_after.items():
                diff = (fsdp["critic_weights"][n] - w).abs().max().item()
                worst["critic_weights"] = max(worst["critic_weights"], diff)
                assert diff <= 1e-5, (algo, n, diff)
            assert all(not torch.equal(c_after[n], critic_before[n]) for n in c_after), algo  # the body trains too
            if algo.get("lora"):  # its own adapter (A and B of every adapted layer) and the head; the base frozen
                assert all(".lora_" in n or n.startswith("lm_head") for n in c_after) and len(c_after) > 4, algo
                assert {"lm_head.weight", "lm_head.bias"} <= set(c_after), algo
            if algo.get("groups") == 3:  # the checkpoint, read into a fresh FSDP2 critic: exactly what was saved
                r = fsdp["resumed"]
                assert r["weights"] == 0.0 and r["optimizer"] == 0.0 and r["scheduler"], r
                assert r["tensors"] == len(c_after) and r["steps"] == (1, 1), r
        elif advantages:
            worst["kl_reward"] = max(worst["kl_reward"], abs(fsdp["record"]["kl_reward"] - rec["kl_reward"]))
            assert fsdp["record"]["kl_reward"] == pytest.approx(rec["kl_reward"], abs=1e-9), algo
            assert (abs(rec["kl_reward"]) > 1e-3) == (cfg.algo.kl_reward_coef > 0), algo  # the return's KL acts
        assert list(fsdp["grads"]) == list(grads)
        warmup = critic is not None and cfg.critic.warmup_steps > 0  # the policy has no gradient
        assert bool(grads) != warmup, algo
        scale = max((g.abs().max().item() for g in grads.values()), default=1.0)
        for n, g in grads.items():
            rel = (fsdp["grads"][n] - g).abs().max().item() / scale
            worst["grads_rel"] = max(worst["grads_rel"], rel)
            assert rel <= 1e-6, (algo, n, rel)
        for k in ("loss", "kl", "entropy", "grad_norm"):
            worst[k] = max(worst[k], abs(fsdp["record"][k] - rec[k]))
            assert fsdp["record"][k] == pytest.approx(rec[k], abs=1e-5), (algo, k)
        if cfg.algo.kl_coef > 0:
            assert rec["kl"] > 1e-3, algo  # the policy is not its reference: the term acts
        assert (rec["entropy"] > 0) == (cfg.algo.entropy_coef > 0), algo
        after = dict(policy.named_weights())
        assert list(fsdp["weights"]) == list(after)
        for n, w in after.items():
            diff = (fsdp["weights"][n] - w).abs().max().item()
            worst["weights"] = max(worst["weights"], diff)
            assert diff <= 1e-5, (algo, n, diff)
        if warmup:
            assert all(torch.equal(after[n], before[n]) for n in after), algo
        else:
            assert all(not torch.equal(after[n], before[n]) for n in after if not n.endswith(".lora_A")), algo
    print(f"max |fsdp2 - single| over {len(got)} configs: {worst}")
