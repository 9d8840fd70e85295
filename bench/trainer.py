"""Trainer throughput: sequence packing vs padded batches on mixed-length samples (not a test).

    .venv/bin/python bench/trainer.py [--threads 2] [--samples 64] [--budget 2048] [--rounds 2] [--broadcast 3]

Both sides run the same model, the same REINFORCE loss and forward + backward over the same samples, with the same
number of micro-batches; padded batches take samples in arrival order and pad each to its longest sample (what a
plain HF training loop does). tokens/s counts real tokens only (prompt + completion, no padding). Prints one table
of ratios from one run. Times are this process's CPU time (time.process_time), so other work on a shared machine
distorts them less than wall time; use --threads 1 there.

`--rl-step` instead times the pipeline's optimizer step on the demo workload (trainer_step.py): the tiny demo model,
16 prompts x 8 samples, the default grpo loss, budget 4096, one thread; `--baseline REV` also times the trainer code of
git revision REV (extracted with `git archive`), alternating the two in fresh processes, and prints the ratio.

`--broadcast N` also pushes the trainer's weights N times to a real `inflight serve` process (WeightSyncClient,
gloo process group and file transport) and compares bytes/s with a plain in-process memory copy of the same tensors.
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

from inflight.config.trainer import TrainerConfig  # noqa: E402
from inflight.contracts import Sample, TrainBatch  # noqa: E402
from inflight.trainer.packing import PaddedBatch, count_loss_tokens, pack_samples, pad_samples  # noqa: E402
from inflight.trainer.single import SingleDeviceTrainer  # noqa: E402


def build_model(out: Path, hidden: int, layers: int, vocab: int = 512) -> None:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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


def broadcast(trainer: SingleDeviceTrainer, model_dir: str, pushes: int) -> None:
    """Wall seconds per push (announce + transfer + every server's answer) vs one memory copy of the same bytes."""
    from inflight.engine.serve import ServerProcess
    from inflight.trainer.weight_sync.inflight import WeightSyncClient

    weights = [(n, t.detach().clone()) for n, t in trainer.named_weights()]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    t0 = time.perf_counter()
    for _ in range(pushes):
        for _, t in weights:
            t.clone()
    copy_s = (time.perf_counter() - t0) / pushes
    print(f"\nweight push: {len(weights)} tensors, {nbytes / 2**20:.1f} MiB; memory copy {copy_s * 1e3:.1f} ms "
          f"({nbytes / copy_s / 1e9:.2f} GB/s)")
    print(f"{'transport':<16}{'push s (median)':>16}{'GB/s':>8}{'vs copy':>9}{'server pause s':>16}")
    with ServerProcess(model_dir, env={"OMP_NUM_THREADS": "1"}) as server:
        for transport in ("process_group", "file"):
            client = WeightSyncClient([server.url], transport=transport, timeout_s=120)
            if transport == "process_group":
                client.init_process_group()
            times, pauses = [], []
            for v in range(pushes):
                res = client.push(iter(weights), version=v + 1 + (pushes if transport == "file" else 0))
                times.append(res["seconds"])
                pauses.extend(res["pause_s"].values())
            client.close()
            med = sorted(times)[len(times) // 2]
            print(f"{transport:<16}{med:>16.3f}{nbytes / med / 1e9:>8.2f}{copy_s / med:>8.2f}x"
                  f"{sorted(pauses)[len(pauses) // 2]:>16.3f}")


def main() -> None:
    if "--rl-step" in sys.argv[1:]:
        from bench.trainer_step import main as rl_step_main

        return rl_step_main([a for a in sys.argv[1:] if a != "--rl-step"])
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--broadcast", type=int, default=0, help="also time N weight pushes to a real server")
    ap.add_argument("--rl-step", action="store_true", help="time one RL optimizer step of the demo instead "
                    "(bench/trainer_step.py; --rl-step --help for its options)")
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
        if args.broadcast:
            broadcast(trainer, d, args.broadcast)


if __name__ == "__main__":
    main()
