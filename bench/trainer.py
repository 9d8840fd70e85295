"""Trainer throughput: sequence packing vs padded batches on mixed-length samples (not a test).

    .venv/bin/python bench/trainer.py [--threads 2] [--samples 64] [--budget 2048] [--rounds 2]

Both sides run the same model, the same REINFORCE loss and forward + backward over the same samples, with the same
number of micro-batches; padded batches take samples in arrival order and pad each to its longest sample (what a
plain HF training loop does). tokens/s counts real tokens only (prompt + completion, no padding). Prints one table
of ratios from one run. Times are this process's CPU time (time.process_time), so other work on a shared machine
distorts them less than wall time; use --threads 1 there.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight.contracts import Sample, TrainBatch  # noqa: E402
from inflight.trainer.config import TrainerConfig  # noqa: E402
from inflight.trainer.packing import PaddedBatch, count_loss_tokens, pack_samples, pad_samples  # noqa: E402
from inflight.trainer.single import SingleDeviceTrainer  # noqa: E402


def build_model(out: Path, hidden: int, layers: int, vocab: int = 512) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=2048, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1").save_pretrained(out)


def make_samples(n: int, dist: str, vocab: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(16, 48)
        if dist == "uniform":
            c = rng.randint(8, 512)
        else:  # long tail: most answers short, a few hit the length limit (typical of RL rollouts)
            c = 512 if rng.random() < 0.1 else min(512, int(rng.expovariate(1 / 60)) + 4)
        out.append(Sample(f"g{i}", [rng.randrange(2, vocab) for _ in range(p)], [rng.randrange(2, vocab) for _ in range(c)],
                          [-1.0] * c, [0] * c))
    return out


def reinforce(logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None):
    return -(batch.advantages * logprobs * batch.loss_mask).sum() / batch.num_samples_in_step, {}


reinforce.needs_entropy = False  # type: ignore[attr-defined]


def padded_backward(model: torch.nn.Module, pb: PaddedBatch, n_step: int) -> None:
    """The plain HF way: [B, L] right-padded with a 2D attention mask."""
    logits = model(input_ids=pb.input_ids, attention_mask=pb.attention_mask, use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, pb.input_ids[:, 1:, None])[..., 0]
    loss = -(pb.advantages[:, 1:] * lp * pb.loss_mask[:, 1:]).sum() / n_step
    loss.backward()


def run(trainer: SingleDeviceTrainer, samples: list[Sample], budget: int, rounds: int) -> dict[str, float]:
    adv = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    real = sum(len(s) for s in samples)
    packed = pack_samples(samples, adv, budget, len(samples), count_loss_tokens(samples))
    per_batch = max(1, round(len(samples) / len(packed)))
    padded = pad_samples(samples, adv, per_batch)
    model = trainer.model
    times = {"packed": [], "padded": []}
    for r in range(rounds + 1):  # round 0 warms up
        for kind in ("packed", "padded"):
            t0 = time.process_time()  # CPU time of this process: robust to other work on a shared machine
            if kind == "packed":
                for mb in packed:
                    trainer.backward(mb, reinforce)
            else:
                model.train()
                for pb in padded:
                    padded_backward(model, pb, len(samples))
            dt = time.process_time() - t0
            trainer.optimizer.zero_grad(set_to_none=True)
            if r > 0:
                times[kind].append(dt)
    t_pack, t_pad = min(times["packed"]), min(times["padded"])
    return {"samples": len(samples), "real_tokens": real, "micro_batches": len(packed),
            "padded_tokens": sum(pb.num_tokens for pb in padded), "packed_tok_s": real / t_pack,
            "padded_tok_s": real / t_pad, "speedup": t_pad / t_pack}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        build_model(Path(d), args.hidden, args.layers)
        trainer = SingleDeviceTrainer(d, TrainerConfig(threads=args.threads))
        trainer.init()
        n_params = sum(p.numel() for p in trainer.model.parameters())
        print(f"model: llama hidden {args.hidden} x {args.layers} layers ({n_params / 1e6:.1f}M params), "
              f"{args.threads} threads, CPU-time tok/s, budget {args.budget} tokens, best of {args.rounds} rounds")
        print(f"{'lengths':<10}{'samples':>8}{'tokens':>8}{'padded':>8}{'mbs':>5}{'packed tok/s':>14}"
              f"{'padded tok/s':>14}{'ratio':>7}")
        for dist in ("uniform", "longtail"):
            r = run(trainer, make_samples(args.samples, dist, 512, seed=0), args.budget, args.rounds)
            print(f"{dist:<10}{r['samples']:>8}{r['real_tokens']:>8}{r['padded_tokens']:>8}{r['micro_batches']:>5}"
                  f"{r['packed_tok_s']:>14.0f}{r['padded_tok_s']:>14.0f}{r['speedup']:>6.2f}x")


if __name__ == "__main__":
    main()
