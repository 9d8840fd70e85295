import math

import pytest
import torch

from inflight.config.trainer import TrainerConfig
from inflight.contracts import TrainEngine
from inflight.trainer.accumulate import StepAccumulator
from inflight.trainer.factory import make_trainer
from inflight.trainer.optim import lr_factor
from inflight.trainer.packing import count_loss_tokens, pack_samples
from inflight.trainer.single import SingleDeviceTrainer

from .helpers import ReinforceLoss, random_samples

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    t = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(lr=1e-2, max_grad_norm=1e9))
    t.init()
    return t


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_is_train_engine(trainer):
    assert isinstance(trainer, TrainEngine)
    assert isinstance(make_trainer(trainer.model_path, TrainerConfig()), SingleDeviceTrainer)
    with pytest.raises(ValueError, match="backend"):
        make_trainer(trainer.model_path, TrainerConfig(backend="nope"))


def test_forward_logprobs_match_float64_reference(trainer):
    vocab = trainer.model.config.vocab_size
    samples = random_samples(9, vocab, seed=3)
    ref_model = type(trainer.model).from_pretrained(trainer.model_path, dtype=torch.float64).eval()
    for temp in (1.0, 0.7):
        mbs = pack_samples(samples, [0.0] * 9, 60, 9, 1, temperature=temp)
        assert len(mbs) > 1 and max(len(mb.seq_lens) for mb in mbs) > 1
        for mb in mbs:
            got = trainer.forward_logprobs(mb)
            start = 0
            for n in mb.seq_lens:
                ids = mb.input_ids[start : start + n]
                with torch.no_grad():
                    logits = ref_model(input_ids=ids[None]).logits[0] / temp  # plain HF forward, one sample
                ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
                assert got[start] == 0.0
                torch.testing.assert_close(got[start + 1 : start + n].double(), ref, atol=2e-5, rtol=0)
                start += n


def test_packed_gradient_equals_unpacked(trainer):
    vocab = trainer.model.config.vocab_size
    samples = random_samples(10, vocab, seed=4)
    adv = [float(i % 3) - 1.0 for i in range(10)]
    loss_fn = ReinforceLoss(needs_entropy=True, entropy_coef=0.1)
    trainer.optimizer.zero_grad(set_to_none=True)
    mbs = pack_samples(samples, adv, 48, 10, 1)
    assert any(len(mb.seq_lens) > 2 for mb in mbs)
    for mb in mbs:
        trainer.backward(mb, loss_fn)
    packed = _grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    for s, a in zip(samples, adv):  # one sample per micro-batch: no packing at all
        (mb,) = pack_samples([s], [a], 10_000, 10, 1)
        trainer.backward(mb, loss_fn)
    single = _grads(trainer.model)
    trainer.optimizer.zero_grad(set_to_none=True)
    assert packed.keys() == single.keys() and len(packed) > 0
    assert max(float(single[n].abs().max()) for n in single) > 1e-3  # not trivially zero
    for n in packed:
        torch.testing.assert_close(packed[n], single[n], atol=1e-5, rtol=1e-4)


def test_entropy_matches_reference(trainer):
    from inflight.trainer.logprobs import packed_logits, token_logprobs

    samples = random_samples(3, trainer.model.config.vocab_size, seed=5)
    (mb,) = pack_samples(samples, [1.0] * 3, 1000, 3, 1)
    with torch.no_grad():
        lp, ent = token_logprobs(packed_logits(trainer.model, mb, "cpu"), mb, need_entropy=True)
    start = 0
    for n in mb.seq_lens:
        with torch.no_grad():
            logits = trainer.model(input_ids=mb.input_ids[start : start + n][None]).logits[0].double()
        p = torch.softmax(logits[:-1], -1)
        ref = -(p * torch.log(p)).sum(-1)
        torch.testing.assert_close(ent[start + 1 : start + n].double(), ref, atol=1e-5, rtol=0)
        assert ent[start] == 0
        start += n


def test_optimizer_step_changes_weights_and_version(tiny_model_dir):
    t = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(lr=1e-3, warmup_steps=2, schedule="cosine", total_steps=4))
    t.init()
    before = {n: w.clone() for n, w in t.named_weights()}
    assert list(before) == list(t.model.state_dict())
    samples = random_samples(4, t.model.config.vocab_size, seed=6)
    for mb in pack_samples(samples, [1.0, -1.0, 0.5, 2.0], 64, 4, 1):
        stats = t.backward(mb, ReinforceLoss())
        assert stats["batch_tokens"] == mb.num_tokens and math.isfinite(stats["loss"])
    out = t.optimizer_step()
    assert t.version == 1 and out["grad_norm"] > 0
    assert out["lr"] == pytest.approx(1e-3 * 0.5)  # warm-up step 1 of 2
    after = dict(t.named_weights())
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert "lm_head.weight" in changed and len(changed) >= len(before) - 1
    assert all(p.grad is None for p in t.model.parameters())
    assert [lr_factor(s, t.cfg) for s in range(5)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])


def test_accumulator_streams_and_equals_one_shot(tiny_model_dir):
    cfg = TrainerConfig(lr=1e-2)
    a, b = SingleDeviceTrainer(str(tiny_model_dir), cfg), SingleDeviceTrainer(str(tiny_model_dir), cfg)
    a.init(), b.init()
    samples = random_samples(12, a.model.config.vocab_size, seed=7)
    adv = [float(i % 2) * 2 - 1 for i in range(12)]
    acc = StepAccumulator(a, ReinforceLoss(), token_budget=40, num_samples_in_step=12, num_tokens_in_step=None)
    acc.add(samples[:6], adv[:6])
    assert acc.stats == []  # token count unknown: waits for the whole step
    acc2 = StepAccumulator(a, ReinforceLoss(), 40, 12, num_tokens_in_step=count_loss_tokens(samples))
    acc2.add(samples[:6], adv[:6])
    assert len(acc2.stats) >= 1  # streaming: backward ran before the step's batch is complete
    acc2.add(samples[6:], adv[6:])
    stats = acc2.finish(step=False)
    assert stats["batch_tokens"] == sum(len(s) for s in samples) and a.version == 0
    for mb in pack_samples(samples, adv, 40, 12, 1):
        b.backward(mb, ReinforceLoss())
    ga, gb = _grads(a.model), _grads(b.model)
    for n in gb:
        torch.testing.assert_close(ga[n], gb[n], atol=1e-6, rtol=1e-5)
    assert a.optimizer_step()["grad_norm"] == pytest.approx(b.optimizer_step()["grad_norm"], rel=1e-5)
    assert a.version == 1


def test_save_roundtrip(trainer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer.save(str(tmp_path))
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert AutoTokenizer.from_pretrained(str(tmp_path)).eos_token == trainer.tokenizer.eos_token
    torch.testing.assert_close(m.state_dict()["lm_head.weight"], trainer.model.state_dict()["lm_head.weight"])


def test_attention_variants_agree(tiny_model_dir):
    """Per-sample SDPA (default), the dense block-diagonal mask (sdpa) and eager give the same packed logprobs;
    the default model still handles a plain padded forward correctly."""
    samples = random_samples(6, 60, seed=8)
    (mb,) = pack_samples(samples, [1.0] * 6, 1000, 6, 1)
    outs = {}
    for attn in ("auto", "sdpa", "eager"):
        t = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(attention=attn))
        t.init()
        outs[attn] = t.forward_logprobs(mb)
    assert t.model.config._attn_implementation == "eager"
    torch.testing.assert_close(outs["auto"], outs["sdpa"], atol=1e-5, rtol=0)
    torch.testing.assert_close(outs["auto"], outs["eager"], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="attention"):
        SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig(attention="nope"))
    # padded plain forward through the default attention equals the unpadded one
    t = SingleDeviceTrainer(str(tiny_model_dir), TrainerConfig())
    t.init()
    a, b = samples[0], samples[1]
    ids_a, ids_b = a.prompt_ids + a.completion_ids, b.prompt_ids + b.completion_ids
    w = max(len(ids_a), len(ids_b))
    ids = torch.zeros(2, w, dtype=torch.long)
    att = torch.zeros(2, w, dtype=torch.long)
    for r, x in enumerate((ids_a, ids_b)):
        ids[r, : len(x)] = torch.tensor(x)
        att[r, : len(x)] = 1
    with torch.no_grad():
        padded = t.model(input_ids=ids, attention_mask=att).logits
        alone = t.model(input_ids=torch.tensor([ids_b])).logits
    torch.testing.assert_close(padded[1, : len(ids_b)], alone[0], atol=1e-5, rtol=0)
