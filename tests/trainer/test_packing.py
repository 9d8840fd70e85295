import pytest
import torch

from inflight.contracts import Sample
from inflight.trainer.packing import count_loss_tokens, first_fit_decreasing, pack_samples, pad_samples

from .helpers import random_samples


def test_first_fit_decreasing_respects_budget_and_keeps_everything():
    lengths = [7, 3, 9, 1, 4, 12, 5, 5, 2]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1
    assert [5] in bins  # 12 > budget: alone
    # FFD: 9+1, 7+3, 5+5, 4+2, 12 -> 5 bins
    assert len(bins) == 5


def test_pack_layout_per_token():
    s1 = Sample("a", prompt_ids=[10, 11], completion_ids=[20, 21, 22], logprobs=[-0.1, -0.2, -0.3], versions=[4, 4, 5])
    s2 = Sample("b", prompt_ids=[], completion_ids=[30, 31], logprobs=[-1.0, -2.0], versions=[7, 8])
    (mb,) = pack_samples([s1, s2], [0.5, -1.5], token_budget=100, num_samples_in_step=9, num_tokens_in_step=17)
    assert mb.input_ids.tolist() == [10, 11, 20, 21, 22, 30, 31]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert mb.seq_lens == [5, 2]
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 1]
    assert mb.advantages.tolist() == [0, 0, 0.5, 0.5, 0.5, -1.5, -1.5]
    assert mb.behaviour_logprobs.tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3, -1.0, -2.0])
    assert mb.versions.tolist() == [-1, -1, 4, 4, 5, 7, 8]
    assert mb.sample_index.tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert (mb.num_samples_in_step, mb.num_tokens_in_step) == (9, 17)
    assert count_loss_tokens([s1, s2]) == int(mb.loss_mask.sum()) == 4


def test_pack_many_budget_and_without_versions():
    samples = random_samples(30, vocab=40, seed=1)
    for s in samples:
        s.logprobs, s.versions = [], []
    with pytest.raises(ValueError, match="with_versions=False"):
        pack_samples(samples, [0.0] * 30, 50, 30, 1)
    mbs = pack_samples(samples, [1.0] * 30, 50, 30, 1, with_versions=False)
    assert sum(len(mb.seq_lens) for mb in mbs) == 30
    assert sum(mb.num_tokens for mb in mbs) == sum(len(s) for s in samples)
    for mb in mbs:
        assert mb.num_tokens <= 50 or len(mb.seq_lens) == 1
        assert (mb.versions == -1).all()
    with pytest.raises(ValueError, match="advantages"):
        pack_samples(samples, [0.0], 50, 30, 1)


def test_pad_samples():
    samples = random_samples(5, vocab=40, seed=2)
    (pb, pb2) = pad_samples(samples, [1.0, 2.0, 3.0, 4.0, 5.0], batch_size=3)
    assert pb.input_ids.shape == (3, max(len(s) for s in samples[:3]))
    assert pb2.input_ids.shape[0] == 2
    for r, s in enumerate(samples[:3]):
        n = len(s)
        assert pb.input_ids[r, :n].tolist() == s.prompt_ids + s.completion_ids
        assert int(pb.attention_mask[r].sum()) == n
        assert int(pb.loss_mask[r].sum()) == count_loss_tokens([s])
    assert torch.all(pb.advantages[1][pb.loss_mask[1] > 0] == 2.0)


def test_environment_tokens_are_context_only():
    """A multi-turn episode: completion = model turn, env turn (loss_mask 0), model turn."""
    s = Sample("e", prompt_ids=[1, 2], completion_ids=[20, 21, 90, 91, 92, 22], logprobs=[-0.1, -0.2, 0, 0, 0, -0.3],
               versions=[3, 3, -1, -1, -1, 4], loss_mask=[1, 1, 0, 0, 0, 1])
    (mb,) = pack_samples([s], [2.0], token_budget=100, num_samples_in_step=1, num_tokens_in_step=3)
    assert mb.input_ids.tolist() == [1, 2, 20, 21, 90, 91, 92, 22]
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 1]
    assert count_loss_tokens([s]) == 3
    assert (s.first_version, s.last_version, s.model_versions()) == (3, 4, [3, 3, 4])
    # no prompt: the first token is not trained either way; an env token first stays untrained
    s0 = Sample("f", prompt_ids=[], completion_ids=[5, 6, 7], logprobs=[0, -1, 0], versions=[-1, 2, -1],
                loss_mask=[0, 1, 0])
    (mb0,) = pack_samples([s0], [1.0], 100, 1, 1)
    assert mb0.loss_mask.tolist() == [0, 1, 0] and count_loss_tokens([s0]) == 1
    s.loss_mask = [1, 0]
    with pytest.raises(ValueError, match="loss_mask"):
        pack_samples([s], [1.0], 100, 1, 3)
