"""SFT warm start: the loss against a float64 reference, the Sample layout, the CLI, and (slow) the accuracy range."""

import json
from itertools import islice

import pytest
import torch

from inflight.config.tasks import TaskConfig
from inflight.contracts import Sample
from inflight.tasks import get_task
from inflight.trainer.packing import count_loss_tokens, pack_samples
from inflight.trainer.sft import SFTLoss, sft_sample

torch.set_num_threads(1)


def _samples(lengths):
    return [Sample(group_id=str(i), prompt_ids=list(range(p)), completion_ids=list(range(c)), logprobs=[],
                   versions=[]) for i, (p, c) in enumerate(lengths)]


def test_sft_loss_is_mean_nll_over_the_step():
    samples = _samples([(3, 2), (5, 4), (1, 6), (2, 1)])
    by_len = {len(s): s for s in samples}  # lengths are distinct: a packed sample is found by its length
    n_tok = count_loss_tokens(samples)
    gen = torch.Generator().manual_seed(0)
    total, ref_sum, ref_n = 0.0, 0.0, 0
    for mb in pack_samples(samples, [1.0] * 4, token_budget=9, num_samples_in_step=4, num_tokens_in_step=n_tok,
                           with_versions=False):
        lp = -torch.rand(mb.num_tokens, generator=gen, dtype=torch.float64)
        loss, stats = SFTLoss()(lp.float().requires_grad_(), mb, None)
        total += float(loss.detach())
        # reference: walk the samples, skip prompt tokens and each sample's first token
        start = 0
        for n in mb.seq_lens:
            p = len(by_len[n].prompt_ids)
            for t in range(start + max(p, 1), start + n):
                ref_sum += -float(lp[t])
                ref_n += 1
            start += n
    assert ref_n == n_tok == 2 + 4 + 6 + 1
    assert total == pytest.approx(ref_sum / ref_n, rel=1e-6)


def test_sft_sample_layout(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = get_task(TaskConfig(eval_size=5))
    ts = next(iter(task.train_samples(0)))
    s = sft_sample(tok, ts, task.solution(ts))
    assert s.completion_ids[-1] == tok.eos_token_id
    assert tok.decode(s.completion_ids[:-1]) == f"\\boxed{{{ts.answer}}}"
    assert tok.decode(s.prompt_ids).endswith("<|im_start|>assistant\n")
    assert ts.messages[0]["content"] in tok.decode(s.prompt_ids)


def test_cli_short_run(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from inflight.cli import main

    out = tmp_path / "sft"
    argv = ["sft", "--task", "arith", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "3",
            "--batch-size", "8", "--eval-every", "2", "--target-acc", "0.99", "task.eval_size=8", "trainer.threads=1"]
    assert main(argv) == 0
    res = json.loads((out / "sft.json").read_text())
    assert res["steps"] == 3 and [h["step"] for h in res["history"]] == [2, 3]
    assert all(h["loss"] > 0 for h in res["history"])
    assert (out / "config.yaml").exists()
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    with pytest.raises(SystemExit, match="no model folder"):
        main(["sft", "--model", str(tmp_path / "nope"), "--out", str(out)])
    with pytest.raises(ValueError, match="wrong_frac"):
        main(argv[:-2] + ["--wrong-frac", "1.5"])


@pytest.mark.slow
def test_warm_start_reaches_the_configured_range(tmp_path):
    """make-model + warm start on an easy arith setting: held-out accuracy lands in [15%, 50%]."""
    from inflight.config.trainer import TrainerConfig
    from inflight.modelkit import make_model
    from inflight.trainer.sft import warm_start

    task_cfg = TaskConfig(digits=1, terms=3, eval_size=100)
    model = make_model(task_cfg, tmp_path / "tiny", size="tiny")
    res = warm_start(model, tmp_path / "sft", task_cfg, TrainerConfig(lr=3e-3, micro_batch_tokens=512, threads=1),
                     wrong_frac=0.3, max_steps=1500, target_acc=0.2, batch_size=64, eval_every=10, progress=False)
    assert res["accuracy"] >= 0.2 and res["steps"] < 1500
    assert 0.15 <= res["accuracy"] <= 0.5
    # the saved model reproduces the accuracy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inflight.trainer.sft import greedy_accuracy

    task = get_task(task_cfg)
    acc = greedy_accuracy(AutoModelForCausalLM.from_pretrained(tmp_path / "sft"),
                          AutoTokenizer.from_pretrained(tmp_path / "sft"), task, task.eval_samples())
    assert acc == pytest.approx(res["accuracy"])
    assert not {s.meta["expr"] for s in task.eval_samples()} & {s.meta["expr"] for s in islice(task.train_samples(0), 500)}
