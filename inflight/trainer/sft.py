"""`inflight sft`: supervised warm start on generated solutions, through the same trainer RL uses.

A share `wrong_frac` of the targets is a wrong answer, and training stops as soon as the held-out greedy accuracy
passes `target_acc`; together they set the starting accuracy RL begins from (aim: 15-50%). Batches are built as
`Sample`s (completion = target tokens + eos) and packed with `pack_samples`, exactly as RL batches are; the loss is
the mean negative log-likelihood over the trained tokens of the optimizer step.

    inflight sft --task arith --model runs/models/tiny --out runs/models/tiny-sft [--wrong-frac 0.3] [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from inflight.config import RunConfig, load_config, save_config
from inflight.contracts import Sample, TaskSample, TrainBatch
from inflight.tasks import get_task
from inflight.config.tasks import TaskConfig
from inflight.modelkit.greedy import greedy_accuracy
from inflight.config.trainer import TrainerConfig
from inflight.trainer.factory import make_trainer
from inflight.trainer.packing import count_loss_tokens, pack_samples


@dataclass
class SFTLoss:
    """Mean NLL over the loss_mask tokens of the whole step (each micro-batch adds its share)."""

    needs_entropy: bool = False

    def __call__(
        self, logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.loss_mask.to(logprobs.dtype)
        loss = -(logprobs * mask).sum() / max(1, batch.num_tokens_in_step)
        return loss, {"nll": float(loss.detach())}


def prompt_ids(tokenizer: Any, sample: TaskSample) -> list[int]:
    text = tokenizer.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sft_sample(tokenizer: Any, sample: TaskSample, target: str) -> Sample:
    """A training Sample whose completion is `target` + eos (no behaviour logprobs: SFT is not sampled)."""
    completion = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Sample(group_id=sample.id, prompt_ids=prompt_ids(tokenizer, sample), completion_ids=completion,
                  logprobs=[], versions=[], reward=1.0, task_id=sample.id)


def warm_start(
    model_dir: str | Path, out_dir: str | Path, task_cfg: TaskConfig, trainer_cfg: TrainerConfig,
    wrong_frac: float = 0.3, max_steps: int = 2000, target_acc: float = 0.3, batch_size: int = 128,
    eval_every: int = 25, max_new_tokens: int | None = None, seed: int = 0, progress: bool = True,
    log: Callable[[str], None] = tqdm.write,
) -> dict[str, Any]:
    """Train until held-out greedy accuracy >= target_acc (or max_steps), save to out_dir, return the metrics."""
    if not 0.0 <= wrong_frac < 1.0:
        raise ValueError(f"wrong_frac must be in [0, 1), got {wrong_frac}")
    task = get_task(task_cfg)
    if not hasattr(task, "solution"):
        raise ValueError(f"task '{task_cfg.name}' has no generated solutions to train on")
    wrong_solution: Callable[[TaskSample, random.Random], str] | None = getattr(task, "wrong_solution", None)
    if wrong_frac > 0 and wrong_solution is None:
        raise ValueError(f"task '{task_cfg.name}' cannot make wrong solutions; use --wrong-frac 0")
    if max_new_tokens is None:
        max_new_tokens = 512 if getattr(task_cfg, "scratchpad", False) else 16
    t0 = time.perf_counter()
    engine = make_trainer(str(model_dir), trainer_cfg)
    engine.init()
    model, tok = engine.model, engine.tokenizer
    rng = random.Random(f"sft-{seed}")
    stream, held_out = task.train_samples(seed), task.eval_samples()
    loss_fn = SFTLoss()

    def evaluate() -> float:
        return greedy_accuracy(model, tok, task, held_out, max_new_tokens)

    acc, step, history = evaluate(), 0, []
    log(f"step 0: held-out accuracy {acc:.1%} ({len(held_out)} problems)")
    bar = tqdm(total=max_steps, desc="sft", disable=not progress, dynamic_ncols=True)
    while acc < target_acc and step < max_steps:
        batch = []
        for s in islice(stream, batch_size):
            wrong = rng.random() < wrong_frac
            batch.append(sft_sample(tok, s, wrong_solution(s, rng) if wrong and wrong_solution is not None
                                    else task.solution(s)))
        n_tok = count_loss_tokens(batch)
        loss = 0.0
        for mb in pack_samples(batch, [1.0] * len(batch), trainer_cfg.micro_batch_tokens, len(batch), n_tok,
                               with_versions=False):
            loss += engine.backward(mb, loss_fn)["nll"]
        opt = engine.optimizer_step()
        step += 1
        bar.update(1)
        if step % eval_every == 0 or step == max_steps:
            acc = evaluate()
            history.append({"step": step, "loss": loss, "acc": acc})
            log(f"step {step}: loss {loss:.4f}  held-out accuracy {acc:.1%}")
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.1%}", grad=f"{opt['grad_norm']:.2f}")
    bar.close()
    engine.save(str(out_dir))
    result = {"steps": step, "accuracy": acc, "target_acc": target_acc, "wrong_frac": wrong_frac,
              "seconds": round(time.perf_counter() - t0, 1), "eval_size": len(held_out), "history": history}
    (Path(out_dir) / "sft.json").write_text(json.dumps(result, indent=1) + "\n")
    if acc < target_acc:
        log(f"warning: stopped at max steps ({step}) below the target accuracy {target_acc:.0%}")
    return result


# ---- CLI ------------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", help="task name (arith | math_jsonl | reasoning_gym); default: the config's")
    p.add_argument("--model", help="model folder to start from (default: the config's model.path)")
    p.add_argument("--out", required=True, help="folder for the warm-started model (save_pretrained)")
    p.add_argument("--wrong-frac", type=float, default=0.3, help="share of wrong targets (default 0.3)")
    p.add_argument("--steps", type=int, default=2000, help="maximum optimizer steps (default 2000)")
    p.add_argument("--target-acc", type=float, default=0.3, help="stop when held-out accuracy passes this (0.3)")
    p.add_argument("--batch-size", type=int, default=128, help="samples per optimizer step (default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3; overrides trainer.lr)")
    p.add_argument("--micro-batch-tokens", type=int, default=1024,
                   help="packing budget per micro-batch (default 1024: packed attention is quadratic in it on CPU)")
    p.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations (default 25)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="eval generation limit (16; 512 scratchpad)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", help="YAML run config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. task.digits=3 trainer.threads=2")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(RunConfig, args.config, args.overrides)
    if args.task:
        cfg.task.name = args.task
    model_dir = args.model or cfg.model.path
    if not Path(model_dir).is_dir():
        raise SystemExit(f"inflight sft: no model folder at {model_dir} (build one with `inflight make-model`)")
    trainer_cfg = dataclasses.replace(cfg.trainer, lr=args.lr, micro_batch_tokens=args.micro_batch_tokens)
    torch.manual_seed(args.seed)
    res = warm_start(model_dir, args.out, cfg.task, trainer_cfg, args.wrong_frac, args.steps, args.target_acc,
                     args.batch_size, args.eval_every, args.max_new_tokens, args.seed)
    save_config(cfg, args.out)
    print(f"warm start: {res['steps']} steps, {res['seconds']} s, held-out accuracy {res['accuracy']:.1%} -> {args.out}")
    return 0
