"""The chunked head (head.py): logprobs and entropy from the hidden states a chunk of tokens at a time, against a
plain float64 reference (full logits, log_softmax, autograd) for values and for gradients w.r.t. the hidden states
and the head's weight; through a real HF model (untied and tied embeddings, packed / shared-prompt / uniform
layouts) against the same model's full logits; and no [T, V] tensor saved for backward."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from inflight.trainer import head
from inflight.trainer.logprobs import packed_token_logprobs, uniform
from inflight.trainer.packing import collate
from inflight.trainer.prefix import shared_layout

from .helpers import random_samples
from .test_prefix import group_samples

torch.set_num_threads(1)


def _reference(hidden, weight, rows, targets, temperature):
    """float64, written plainly: the full logits, log_softmax, the target's logprob and the entropy."""
    logp = torch.log_softmax(hidden[rows] @ weight.T / temperature, dim=-1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _case(seed, n=23, h=16, v=61, m=40):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7
    rows = torch.randint(0, n, (m,), generator=g)  # repeats: one hidden row predicting several tokens
    targets = torch.randint(0, v, (m,), generator=g)
    w_lp, w_ent = torch.randn(m, generator=g, dtype=torch.float64), torch.randn(m, generator=g, dtype=torch.float64)
    return hidden, weight, rows, targets, w_lp, w_ent


def _grads(fn, hidden, weight, w_lp, w_ent):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fn(h, w)
    ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
    return lp.detach().double(), ent.detach().double(), h.grad.double(), w.grad.double()


@pytest.mark.parametrize("chunk_rows", [1, 7, 40, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_float64_equals_plain_reference(chunk_rows, temperature):
    hidden, weight, rows, targets, w_lp, w_ent = _case(0)
    v = weight.shape[0]
    got = _grads(lambda h, w: head.head_logprobs(h, w, rows, targets, temperature, True, chunk_rows * v),
                 hidden, weight, w_lp, w_ent)
    ref = _grads(lambda h, w: _reference(h, w, rows, targets, temperature), hidden, weight, w_lp, w_ent)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_without_entropy_and_float32_bf16():
    hidden, weight, rows, targets, w_lp, _ = _case(1)
    v = weight.shape[0]
    zero = torch.zeros_like(w_lp)
    ref = _grads(lambda h, w: _reference(h, w, rows, targets, 0.8), hidden, weight, w_lp, zero)
    lp_only = _grads(lambda h, w: (head.head_logprobs(h, w, rows, targets, 0.8, False, 5 * v)[0], torch.zeros(1)),
                     hidden, weight, w_lp, zero[:1])
    for i in (0, 2, 3):
        torch.testing.assert_close(lp_only[i], ref[i], atol=1e-12, rtol=1e-10)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        h, w = hidden.to(dtype), weight.to(dtype)  # the reference on the same rounded inputs
        ref = _grads(lambda a, b: _reference(a, b, rows, targets, 0.8), h.double(), w.double(), w_lp, w_lp)
        got = _grads(lambda a, b: head.head_logprobs(a, b, rows, targets, 0.8, True, 3 * v), h, w, w_lp, w_lp)
        assert got[0].dtype == torch.float64  # (converted); the function itself returns float32 for both
        scale = [max(1.0, float(r.abs().max())) for r in ref]
        for a, b, s in zip(got, ref, scale):
            torch.testing.assert_close(a / s, b / s, atol=tol, rtol=0)


def test_empty_request_keeps_the_graph():
    hidden, weight, _, _, _, _ = _case(2)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, _ = head.head_logprobs(h, w, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 1.0, False)
    assert lp.shape == (0,) and lp.requires_grad
    (0.0 * lp.sum()).backward()
    assert h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


def _model(model_dir, dtype):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="inflight_packed")


def _batches(vocab):
    yield collate(random_samples(7, vocab, seed=5), [1.0] * 7, 7, 100, temperature=0.7)  # packed, varied lengths
    yield collate(group_samples(vocab, seed=6), [1.0] * 13, 13, 100)  # shared prompts (compact layout, `back`)
    same = [s for s in random_samples(40, vocab, seed=7, min_len=9, max_len=9)][:4]
    yield collate(same, [1.0] * 4, 4, 100)  # equal lengths: a [B, L] batch


@pytest.mark.parametrize("tied", [False, True])
def test_model_chunked_equals_full_logits_float64(tiny_model_dir, tied_model_dir, tied):
    """float64 model: the chunked head's logprobs, entropies and every parameter's gradient (the tied embedding's
    included) equal those of the model's full logits through a plain log_softmax."""
    model_dir = tied_model_dir if tied else tiny_model_dir
    plain, chunked = _model(model_dir, torch.float64), _model(model_dir, torch.float64)
    assert head.install(chunked) and not head.installed(plain)
    assert (chunked.lm_head.weight is chunked.model.embed_tokens.weight) == tied
    vocab = plain.config.vocab_size
    for batch in _batches(vocab):
        g = torch.Generator().manual_seed(len(batch.seq_lens))
        w_lp, w_ent = (torch.randn(batch.input_ids.shape[0], generator=g, dtype=torch.float64) for _ in range(2))
        results = []
        for model in (plain, chunked):
            model.zero_grad(set_to_none=True)
            lp, ent = packed_token_logprobs(model, batch, "cpu", need_entropy=True, chunk_elems=3 * vocab)
            ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            results.append((lp.detach(), ent.detach(), grads))
        (lp0, ent0, g0), (lp1, ent1, g1) = results
        torch.testing.assert_close(lp1, lp0, atol=1e-12, rtol=0)
        torch.testing.assert_close(ent1, ent0, atol=1e-12, rtol=0)
        assert g0.keys() == g1.keys() and len(g0) > 5
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], atol=1e-11, rtol=1e-9, msg=n)
        assert float(g1["model.embed_tokens.weight"].abs().sum()) > 0


def test_model_autocast_bf16_close_to_full_logits(tiny_model_dir):
    """Under bf16 autocast (the GPU trainer's precision) the head runs in bf16 like autocast's linear: the chunked
    logprobs stay within bf16 rounding of the full-logit path."""
    plain, chunked = _model(tiny_model_dir, torch.float32), _model(tiny_model_dir, torch.float32)
    head.install(chunked)
    batch = next(_batches(plain.config.vocab_size))
    outs = []
    for model in (plain, chunked):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = packed_token_logprobs(model, batch, "cpu", need_entropy=True)
        assert lp.dtype == torch.float32
        lp.sum().backward()
        outs.append((lp.detach(), ent.detach(), model.lm_head.weight.grad.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=5e-2, rtol=0)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=5e-2, rtol=0)
    torch.testing.assert_close(outs[1][2], outs[0][2], atol=5e-2, rtol=5e-2)


class _LogitShapes(TorchDispatchMode):
    """Records the number of rows of every op output that is logits-wide ([..., V]), forward and backward."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # no new memory (e.g. the weight's transpose)
            return out
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] == self.vocab:
                self.rows.append(x.numel() // self.vocab)
        return out


def test_no_tokens_by_vocab_tensor(tiny_model_dir):
    """No op makes a logits-wide tensor of more than one chunk's rows, forward or backward, with the chunked head;
    the full-logits path makes [T, V] ones (the check can fail)."""
    plain, chunked = _model(tiny_model_dir, torch.float32), _model(tiny_model_dir, torch.float32)
    head.install(chunked)
    vocab = plain.config.vocab_size
    batch = next(_batches(vocab))
    t = batch.input_ids.shape[0]
    largest = []
    for model in (plain, chunked):
        with _LogitShapes(vocab) as seen:
            lp, ent = packed_token_logprobs(model, batch, "cpu", need_entropy=True, chunk_elems=4 * vocab)
            (lp.sum() + ent.sum()).backward()
        largest.append(max(seen.rows, default=0))
    assert largest[0] >= t - 1  # the model's logits and their gradient
    assert 0 < largest[1] <= 4  # one chunk of 4 tokens


def test_unsupported_heads_keep_the_logits(tiny_model_dir):
    model = _model(tiny_model_dir, torch.float32)
    model.config.final_logit_softcapping = 30.0
    assert "softcapping" in head.supported(model) and not head.install(model)
    model.config.final_logit_softcapping = None
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
    assert "bias" in head.supported(model)


def test_batches_cover_the_three_layouts():
    packed, shared, same = _batches(82)
    assert not uniform(packed) and shared_layout(packed, "cpu") is None
    assert shared_layout(shared, "cpu") is not None
    assert uniform(same) and len(same.seq_lens) > 1


def test_frozen_head_weight_gets_no_gradient_work():
    """A frozen head (LoRA trains adapters only): the hidden states' gradient equals the float64 reference and the
    backward makes no [V, H] tensor (the unfrozen head does: the check can fail)."""
    hidden, weight, rows, targets, w_lp, w_ent = _case(3)
    v, h_dim = weight.shape
    ref = _grads(lambda h, w: _reference(h, w, rows, targets, 0.9), hidden, weight, w_lp, w_ent)
    for frozen in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(not frozen)
        lp, ent = head.head_logprobs(h, w, rows, targets, 0.9, True, 5 * v)
        with _LogitShapes(h_dim) as seen:  # outputs whose last dimension is H: [V, H] is the weight's gradient
            ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        torch.testing.assert_close(h.grad, ref[2], atol=1e-12, rtol=1e-10)
        assert (max(seen.rows) >= v) != frozen, seen.rows
        assert (w.grad is None) == frozen


def test_trained_only_equals_all_tokens_where_the_loss_trains(tiny_model_dir, tied_model_dir):
    """`trained_only` (the trainers' backward): the head runs on the trained tokens only (fewer rows than the
    tokens the batch predicts, prompts included); their logprobs and every parameter's gradient of a loss over
    them equal the all-tokens path's in float64, and the other tokens hold 0."""
    for model_dir in (tiny_model_dir, tied_model_dir):
        model = _model(model_dir, torch.float64)
        assert head.install(model)
        vocab = model.config.vocab_size
        for batch in _batches(vocab):
            trained = batch.loss_mask > 0
            g = torch.Generator().manual_seed(len(batch.seq_lens))
            w_lp, w_ent = (torch.randn(batch.input_ids.shape[0], generator=g, dtype=torch.float64) * trained
                           for _ in range(2))
            results = []
            for only in (False, True):
                model.zero_grad(set_to_none=True)
                with _LogitShapes(vocab) as seen:
                    lp, ent = packed_token_logprobs(model, batch, "cpu", need_entropy=True, chunk_elems=10**6,
                                                    trained_only=only)
                ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                results.append((lp.detach(), ent.detach(), grads, max(seen.rows)))
            (lp0, ent0, g0, rows0), (lp1, ent1, g1, rows1) = results
            assert rows1 == int(trained.sum()) < rows0
            torch.testing.assert_close(lp1[trained], lp0[trained], atol=1e-12, rtol=0)
            torch.testing.assert_close(ent1[trained], ent0[trained], atol=1e-12, rtol=0)
            assert not lp1[~trained].any() and not ent1[~trained].any()
            for n in g0:
                torch.testing.assert_close(g1[n], g0[n], atol=1e-11, rtol=1e-9, msg=n)
