"""The trainer + grpo learn at all: a bandit-like task where reward = 1 iff the first generated token is '7'."""

import torch

from inflight.algo import AlgoConfig, compute_advantages, make_loss, merge_stats
from inflight.config.trainer import TrainerConfig
from inflight.contracts import Sample
from inflight.trainer.accumulate import StepAccumulator
from inflight.trainer.packing import count_loss_tokens
from inflight.trainer.single import SingleDeviceTrainer


@torch.no_grad()
def sample(model, prompt: list[int], n: int, new_tokens: int, gen: torch.Generator):
    """n completions of `new_tokens` tokens at temperature 1 (plain forward per token; no cache needed here)."""
    ids = torch.tensor([prompt] * n)
    lps = []
    for _ in range(new_tokens):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        lps.append(logp.gather(-1, tok))
        ids = torch.cat([ids, tok], 1)
    return ids[:, len(prompt):].tolist(), torch.cat(lps, 1).tolist()


def test_grpo_bandit_reward_rises(tiny_model_dir):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    t = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(lr=3e-3, max_grad_norm=1.0))
    t.init()
    tok = t.tokenizer
    target = tok.convert_tokens_to_ids("7")
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("a?", "b?", "c?", "d?")]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    algo = AlgoConfig(loss="grpo")
    loss_fn = make_loss(algo)
    gen = torch.Generator().manual_seed(0)
    rewards_per_step = []
    for step in range(150):
        groups: list[list[Sample]] = []
        t.model.eval()
        for g, prompt in enumerate(prompts):
            comps, lps = sample(t.model, prompt, 8, 2, gen)
            groups.append([
                Sample(group_id=f"{step}-{g}", prompt_ids=list(prompt), completion_ids=c, logprobs=lp,
                       versions=[t.version] * len(c), reward=float(c[0] == target))
                for c, lp in zip(comps, lps)
            ])
        adv = compute_advantages([[s.reward for s in grp] for grp in groups], algo)
        samples = [s for grp in groups for s in grp]
        acc = StepAccumulator(t, loss_fn, 64, len(samples), count_loss_tokens(samples), merge=merge_stats)
        for grp, a in zip(groups, adv):  # as groups arrive
            acc.add(grp, a)
        stats = acc.finish()
        assert stats["micro_batches"] > 1 and 0.5 < stats["ratio_mean"] < 2.0
        rewards_per_step.append(sum(s.reward for s in samples) / len(samples))
        if step >= 20 and sum(rewards_per_step[-5:]) / 5 > 0.9:
            break
    first = sum(rewards_per_step[:5]) / 5
    last = sum(rewards_per_step[-5:]) / 5
    assert first < 0.2, rewards_per_step[:5]
    assert last > 0.8 and last > first + 0.5, (first, last, len(rewards_per_step))
