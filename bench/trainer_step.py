"""One RL optimizer step of the CPU demo, timed and broken down (`bench/trainer.py --rl-step`; not a test).

    .venv/bin/python bench/trainer.py --rl-step [--lengths fixed|varied] [--baseline REV] [--steps 20] [--rounds 3]
    .venv/bin/python bench/trainer.py --rl-step --model .cache/models/smollm2-135m-instruct --lora 8 --groups 1 \
        --prompt-tokens 43 --baseline REV --steps 5    # `make demo-real`'s step: one informative group, LoRA

The step the pipeline's trainer runs (inflight/trainer/loop/trainer_loop.py) on the demo workload: the tiny demo model
(inflight.modelkit `make_model(size="tiny")`, arith tokenizer), 16 prompts x 8 samples, prompts of 10 tokens and
completions of 12 (`fixed`) or 2..12 (`varied`, mean 7, like the demo once the model stops at EOS), the default
grpo loss, micro-batch budget 4096 tokens, one thread: pack -> backward per micro-batch -> optimizer step.
`--groups`, `--prompt-tokens` and `--lora RANK` (an adapter of that rank, alpha 2 x rank, on every linear layer)
change the workload, e.g. to the real-model demo's (SmolLM2, 43-token chat prompts, the one or two groups per step
that have a non-zero advantage).
Times are CPU time of the measuring process (time.process_time), so the other work on a shared machine distorts
them less than wall time.

`--baseline REV` extracts the `inflight/` package of git revision REV (`git archive`, read-only) and times both codes
in fresh processes, alternating (A B A B) to cancel drift; the ratio of the medians is the speed-up.
The phase breakdown (pack, forward with the logprobs, loss, backward, optimizer) runs the trainer's own functions
one by one, as `SingleDeviceTrainer.backward` chains them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("pack", "forward", "loss", "backward", "optimizer")


def workload(vocab: int, lengths: str, groups: int = 16, prompt_tokens: int = 10, seed: int = 0):
    """groups x 8 samples with group-mean advantages of 0/1 rewards and behaviour logprobs near the current
    policy's (a ratio close to 1, as in a pipelined run)."""
    from inflight.contracts import Sample

    rng = random.Random(seed)
    samples, adv = [], []
    for g in range(groups):
        rewards = [float(rng.random() < 0.3) for _ in range(8)]
        mean = sum(rewards) / 8
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]  # one prompt per group
        for r in rewards:
            c = 12 if lengths == "fixed" else rng.randint(2, 12)
            samples.append(Sample(f"g{g}", list(prompt), [rng.randrange(3, vocab) for _ in range(c)],
                                  [-4.8 + 0.1 * rng.random() for _ in range(c)], [0] * c))
            adv.append(r - mean)
    return samples, adv


def child(model_dir: str, args, phases: bool) -> dict:
    """Runs inside a process whose sys.path starts with the code under test."""
    import torch

    from inflight.algo.losses import make_loss
    from inflight.config.algo import AlgoConfig
    from inflight.config.trainer import LoraConfig, TrainerConfig
    from inflight.trainer.packing import count_loss_tokens, pack_samples
    from inflight.trainer.single import SingleDeviceTrainer

    try:  # what the pipeline's role processes do at start, where the code under test has it
        from inflight.process import retain_freed_memory

        retain_freed_memory()
    except ImportError:
        pass
    torch.set_num_threads(1)
    lora = LoraConfig(rank=args.lora, alpha=2.0 * args.lora) if args.lora else None
    trainer = SingleDeviceTrainer(model_dir, TrainerConfig(threads=1, micro_batch_tokens=4096, lora=lora))
    trainer.init()
    samples, adv = workload(trainer.model.config.vocab_size, args.lengths, args.groups, args.prompt_tokens)
    steps = args.steps
    loss_fn = make_loss(AlgoConfig())
    n_tok = count_loss_tokens(samples)

    def step() -> int:
        mbs = pack_samples(samples, adv, 4096, len(samples), n_tok)
        for mb in mbs:
            trainer.backward(mb, loss_fn)
        trainer.optimizer_step()
        return len(mbs)

    for _ in range(3):
        micro = step()
    times = []
    for _ in range(args.rounds):
        t0 = time.process_time()
        for _ in range(steps):
            step()
        times.append((time.process_time() - t0) / steps)
    out = {"step_s": times, "micro_batches": micro, "tokens": sum(len(s) for s in samples), "loss_tokens": n_tok,
           "params": sum(p.numel() for p in trainer.model.parameters())}
    if phases:
        out["phases"] = phase_times(trainer, samples, adv, loss_fn, n_tok, steps)
    return out


def phase_times(trainer, samples, adv, loss_fn, n_tok: int, steps: int) -> dict[str, float]:
    """CPU seconds per step of each phase, the trainer's functions called one by one ("forward": the model and its
    token logprobs, as `SingleDeviceTrainer.backward` computes them in the code under test)."""
    import inspect

    from inflight.trainer import single
    from inflight.trainer.logprobs import packed_token_logprobs
    from inflight.trainer.packing import pack_samples

    trained_only = "trained_only" in inspect.signature(packed_token_logprobs).parameters
    kwargs = {"trained_only": True} if trained_only else {}

    acc = dict.fromkeys(PHASES, 0.0)
    clock = time.process_time
    for _ in range(steps):
        t = clock()
        mbs = pack_samples(samples, adv, 4096, len(samples), n_tok)
        acc["pack"] += clock() - t
        for mb in mbs:
            trainer.model.train()
            t = clock()
            lp, ent = packed_token_logprobs(trainer.model, mb, trainer.device, **kwargs)
            t1 = clock()
            loss, _ = single.run_loss(lp, ent, single.batch_to(mb, trainer.device), loss_fn)
            t2 = clock()
            loss.backward()
            t3 = clock()
            for k, dt in zip(PHASES[1:4], (t1 - t, t2 - t1, t3 - t2)):
                acc[k] += dt
        t = clock()
        trainer.optimizer_step()
        acc["optimizer"] += clock() - t
    return {k: v / steps for k, v in acc.items()}


def run_child(src: Path, model_dir: str, args, phases: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(src), "--model", model_dir,
           "--lengths", args.lengths, "--steps", str(args.steps), "--rounds", "1", "--groups", str(args.groups),
           "--prompt-tokens", str(args.prompt_tokens), "--lora", str(args.lora)] + (["--phases"] if phases else [])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({src}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench/trainer.py --rl-step")
    ap.add_argument("--lengths", choices=("fixed", "varied"), default="fixed")
    ap.add_argument("--baseline", default="", help="git revision whose trainer code to compare against")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per timed round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (one fresh process per side each)")
    ap.add_argument("--model", default="", help="an existing model folder (default: build the tiny demo model)")
    ap.add_argument("--groups", type=int, default=16, help="groups of 8 samples per step")
    ap.add_argument("--prompt-tokens", type=int, default=10, help="tokens of each group's prompt")
    ap.add_argument("--lora", type=int, default=0, help="train a LoRA adapter of this rank (0: full fine-tuning)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--phases", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, args.child)
        print(json.dumps(child(args.model, args, args.phases)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if not model_dir:
            sys.path.insert(0, str(ROOT))
            from inflight.config.tasks import TaskConfig
            from inflight.modelkit.build import make_model

            model_dir = str(make_model(TaskConfig(name="arith"), Path(tmp) / "model", size="tiny"))
        sides = {"current": ROOT}
        if args.baseline:
            base = Path(tmp) / "baseline"
            base.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline, "inflight"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
            sides = {f"baseline {args.baseline}": base, "current": ROOT}
        runs: dict[str, list[dict]] = {k: [] for k in sides}
        for r in range(args.rounds):  # A B A B; the first round also measures the phases
            for name, src in sides.items():
                runs[name].append(run_child(src, model_dir, args, phases=r == 0))
        first = runs["current"][0]
        print(f"RL step: {first['params'] / 1e6:.2f}M params{f' (LoRA rank {args.lora})' if args.lora else ''}, "
              f"{8 * args.groups} samples ({args.lengths} lengths, {args.prompt_tokens}-token prompts), "
              f"{first['tokens']} tokens ({first['loss_tokens']} trained), {first['micro_batches']} micro-batch(es), "
              f"1 thread, CPU s per step: median of {args.rounds} processes x {args.steps} steps")
        print(f"{'code':<22}{'step s':>9}{'(min-max)':>16}" + "".join(f"{p:>10}" for p in PHASES))
        med = {}
        for name, rs in runs.items():
            ts = [r["step_s"][0] for r in rs]
            med[name] = statistics.median(ts)
            ph = rs[0]["phases"]
            print(f"{name:<22}{med[name]:>9.4f}{f'({min(ts):.4f}-{max(ts):.4f})':>16}"
                  + "".join(f"{ph[p]:>10.4f}" for p in PHASES))
        if args.baseline:
            b = med[f"baseline {args.baseline}"]
            print(f"speed-up: {b / med['current']:.2f}x (current step = {med['current'] / b:.2f} of the baseline's)")


if __name__ == "__main__":
    main()
