"""Fast paths of the packed forward: shared prompts (prefix.py), equal-length samples as a [B, L] batch, and no
dense mask inside a packed call. Each must give the gradients of one plain forward per sample."""

import random

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.contracts import Sample
from inflight.trainer import prefix
from inflight.trainer.kernels import attention, row_attention
from inflight.trainer.kernels.attention import packed_call, packed_mask
from inflight.trainer.logprobs import uniform
from inflight.trainer.packing import pack_samples
from inflight.trainer.prefix import shared_layout
from inflight.trainer.single import SingleDeviceTrainer

from .helpers import ReinforceLoss

torch.set_num_threads(1)


def group_samples(vocab: int, seed: int, groups: int = 3, size: int = 4, fixed: int = 0) -> list[Sample]:
    """GRPO-like: `size` samples per group share one prompt; completion lengths vary (or all `fixed`). A last
    sample without a prompt stands alone."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(2, 7) if not fixed else 5)]
        for _ in range(size):
            c = fixed or rng.randint(1, 9)
            out.append(Sample(f"g{g}", list(prompt), [rng.randrange(4, vocab) for _ in range(c)],
                              [-rng.random() for _ in range(c)], [0] * c))
    c = fixed + 5 if fixed else 6
    out.append(Sample("solo", [], [rng.randrange(4, vocab) for _ in range(c)], [-0.5] * c, [0] * c))
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference_grads(t: SingleDeviceTrainer, samples: list[Sample], adv: list[float]) -> dict[str, torch.Tensor]:
    """One plain HF forward per sample ([1, n], no packing, no sharing), float32, REINFORCE written here."""
    t.optimizer.zero_grad(set_to_none=True)
    for s, a in zip(samples, adv):
        ids = torch.tensor(s.prompt_ids + s.completion_ids)
        logits = t.model(input_ids=ids[None], use_cache=False).logits[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        trained = lp[max(len(s.prompt_ids), 1) - 1 :]  # completion tokens (not the first token of the sample)
        (-(a * trained.sum()) / len(samples)).backward()
    g = _grads(t.model)
    t.optimizer.zero_grad(set_to_none=True)
    return g


def _trainer(tiny_model_dir, **kw) -> SingleDeviceTrainer:
    t = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(**kw))
    t.init()
    return t


@pytest.mark.parametrize("kernel", [True, False], ids=["C-attention", "sdpa-buckets"])
@pytest.mark.parametrize("fixed", [0, 6])
def test_shared_prompts_equal_per_sample_gradients(tiny_model_dir, fixed, kernel, monkeypatch):
    """With the C row attention (row_attention.py) and with the SDPA buckets it replaces where it cannot run."""
    torch.set_num_threads(1)  # the C kernels run only with torch on one thread
    if kernel and not row_attention.usable(torch.zeros(1)):
        pytest.skip("no C compiler here")
    if not kernel:
        monkeypatch.setattr(prefix, "usable", lambda *a: False)
        monkeypatch.setattr(attention, "usable", lambda *a: False)
    t = _trainer(tiny_model_dir)
    vocab = t.model.config.vocab_size
    samples = group_samples(vocab, seed=fixed, fixed=fixed)
    adv = [((i * 7) % 5 - 2) / 2 for i in range(len(samples))]
    (mb,) = pack_samples(samples, adv, 10_000, len(samples), 1)
    layout = shared_layout(mb, "cpu")
    assert layout is not None and layout.num_tokens < mb.num_tokens  # the prompts really are shared
    t.optimizer.zero_grad(set_to_none=True)
    t.backward(mb, ReinforceLoss())
    got = _grads(t.model)
    ref = _reference_grads(t, samples, adv)
    assert got.keys() == ref.keys() and max(float(g.abs().max()) for g in ref.values()) > 1e-3
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4)
    # logprobs of every token (prompt positions too) equal those of the unshared packed forward
    plain = _trainer(tiny_model_dir)
    plain.share_prompts = False
    torch.testing.assert_close(t.forward_logprobs(mb), plain.forward_logprobs(mb), atol=1e-5, rtol=0)


def test_shared_prompts_with_gradient_checkpointing(tiny_model_dir):
    """The recompute in backward gets the layout through the attention keyword, not from a context."""
    t = _trainer(tiny_model_dir, gradient_checkpointing=True)
    samples = group_samples(t.model.config.vocab_size, seed=5)
    adv = [1.0 if i % 2 else -0.5 for i in range(len(samples))]
    (mb,) = pack_samples(samples, adv, 10_000, len(samples), 1)
    t.optimizer.zero_grad(set_to_none=True)
    t.backward(mb, ReinforceLoss())
    got = _grads(t.model)
    ref = _reference_grads(t, samples, adv)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4)


def test_no_shared_prompt_gives_no_layout(tiny_model_dir):
    samples = [Sample("a", [5, 6], [7, 8], [-1.0, -1.0], [0, 0]), Sample("b", [5, 9], [7], [-1.0], [0])]
    (mb,) = pack_samples(samples, [1.0, -1.0], 100, 2, 1)
    assert shared_layout(mb, "cpu") is None


def test_equal_lengths_run_as_a_batch(tiny_model_dir):
    """Equal-length samples with different prompts: the [B, L] path, same gradients as per-sample forwards."""
    t = _trainer(tiny_model_dir)
    t.share_prompts = False  # (different prompts anyway)
    rng = random.Random(11)
    vocab = t.model.config.vocab_size
    samples = []
    for i in range(6):
        p = 1 + i % 3  # prompt lengths differ, total lengths do not
        samples.append(Sample(f"g{i}", [rng.randrange(4, vocab) for _ in range(p)],
                              [rng.randrange(4, vocab) for _ in range(9 - p)], [-0.3] * (9 - p), [0] * (9 - p)))
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, 0.0]
    (mb,) = pack_samples(samples, adv, 10_000, 6, 1)
    assert uniform(mb)
    t.optimizer.zero_grad(set_to_none=True)
    t.backward(mb, ReinforceLoss())
    got = _grads(t.model)
    ref = _reference_grads(t, samples, adv)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4)
    other = samples[:2] + group_samples(vocab, 1, groups=1, size=1)
    (mixed,) = pack_samples(other, [0.0] * len(other), 10_000, len(other), 1)
    assert not uniform(mixed)


def test_packed_call_builds_no_mask():
    kw = dict(batch_size=1, q_length=4, kv_length=4, attention_mask=torch.tensor([[1, 1, 1, 0]]))
    assert packed_mask(**kw) is not None  # padding: a plain call still gets transformers' mask
    with packed_call():
        assert packed_mask(**kw) is None
    assert packed_mask(**kw) is not None


def test_packed_call_refuses_attention_without_boundaries():
    """A model that drops the forward's keywords must not run maskless SDPA over several samples."""
    from inflight.trainer.kernels.attention import packed_sdpa

    q = torch.randn(1, 2, 5, 4)
    out, _ = packed_sdpa(torch.nn.Module(), q, q, q, None)  # a plain call outside packed_call: causal SDPA
    assert out.shape == (1, 5, 2, 4)
    with packed_call(), pytest.raises(RuntimeError, match="keyword"):
        packed_sdpa(torch.nn.Module(), q, q, q, None)
