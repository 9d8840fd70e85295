"""TRL `GRPOTrainer` on inflight's arith task; run inside TRL's own venv (bench/peers.py sets it up and calls this).

    .cache/peers/trl/bin/python bench/peers/trl_grpo.py --model DIR --out OUT.jsonl --minutes 3

Settings matched to inflight's config of the preset (arith_eval.PRESETS; `tiny`: configs/cpu-demo.yaml, 16 prompts
x 8 samples per optimizer step, max 12 new tokens, temperature 1; `smollm2`: configs/cpu-smollm2.yaml, 4 x 8, 24
new tokens, temperature 0.7, system prompt, last-number answers; `smollm2-lora`: the same with a PEFT LoRA adapter
as inflight's, rank 8, alpha 16, every linear layer but the head): lr (--lr) constant, AdamW
(betas 0.9/0.999, no weight decay), advantage = reward - group mean (no std
scaling), no KL, one gradient step per generation (on-policy). Loss normalisation: TRL's `dr_grpo` divides the
token sum by batch x max_completion_length, inflight's `sequences` by batch only, i.e. a constant factor L (the new
tokens); Adam is invariant to that factor, so only the gradient clip sees it: max_grad_norm = 1.0 / L makes the two
the same.
Gradient checkpointing (on by default in GRPOConfig) is turned off: it only recomputes activations here.
Reward: 1 when the task's verifier calls the completion correct, else 0 (what inflight's arith reward gives).

Writes one JSON line per optimizer step ({"event": "step", ...}) and per held-out evaluation ({"event": "eval"}).
`time` counts training wall time only: the evaluation's own seconds are subtracted (inflight evaluates through its
servers concurrently, so its eval time is hidden the same way).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arith_eval import PRESETS, arith_task, greedy_accuracy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    task, preset = arith_task(args.preset), PRESETS[args.preset]
    batch, new_tokens = preset["prompts_per_step"] * preset["group_size"], preset["max_new_tokens"]
    prompts, n_steps_data = [], min(args.max_steps, 2_000)
    by_id = {}
    for s in task.train_samples(args.seed):
        by_id[s.id] = s
        prompts.append({"prompt": s.messages, "sample_id": s.id})
        if len(prompts) >= preset["prompts_per_step"] * n_steps_data:
            break

    def reward(completions, sample_id, **_) -> list[float]:
        out = []
        for c, sid in zip(completions, sample_id):
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(1.0 if task.verify(text, by_id[sid]).label.value == "correct" else 0.0)
        return out

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    out = open(args.out, "w")

    def emit(**rec) -> None:
        out.write(json.dumps(rec) + "\n")
        out.flush()

    class Clock(TrainerCallback):
        """Training wall time without the evaluations; stops at --minutes; evaluates every --eval-every steps."""

        def __init__(self) -> None:
            self.t0, self.eval_s = time.perf_counter(), 0.0

        def elapsed(self) -> float:
            return time.perf_counter() - self.t0 - self.eval_s

        def evaluate(self, step: int, model) -> None:
            t = time.perf_counter()
            acc = greedy_accuracy(model, tok, task, new_tokens)
            self.eval_s += time.perf_counter() - t
            emit(event="eval", step=step, samples=step * batch, time=self.elapsed(), accuracy=acc)

        def on_train_begin(self, a, state, control, model=None, **kw):
            self.t0 = time.perf_counter()
            self.evaluate(0, model)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:  # means over the logging_steps since the last log
                emit(event="log", step=state.global_step, mean_length=logs["completions/mean_length"],
                     max_length=logs.get("completions/max_length"), clipped_ratio=logs.get("completions/clipped_ratio"),
                     reward=logs.get("reward"))

        def on_step_end(self, a, state, control, model=None, **kw):
            emit(event="step", step=state.global_step, samples=state.global_step * batch, time=self.elapsed())
            if state.global_step % args.eval_every == 0:
                self.evaluate(state.global_step, model)
            if self.elapsed() > 60 * args.minutes:
                control.should_training_stop = True
            return control

    cfg = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix(".trl")), use_cpu=True, use_vllm=False, seed=args.seed,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=preset["group_size"],
        max_completion_length=new_tokens, temperature=preset["temperature"], top_p=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0 / new_tokens,
        loss_type="dr_grpo", scale_rewards="none", beta=0.0, num_iterations=1,
        max_steps=args.max_steps, logging_steps=10, save_strategy="no", report_to=[],
        bf16=False, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False,  # TRL's default is True: it only recomputes activations on these models
    )
    peft_config = None
    if "lora" in preset:  # PEFT's LoRA as inflight's trainer.lora builds it: every linear layer but the head
        from peft import LoraConfig

        peft_config = LoraConfig(r=preset["lora"]["rank"], lora_alpha=preset["lora"]["alpha"], lora_dropout=0.0,
                                 target_modules="all-linear", bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(prompts),
                          processing_class=tok, callbacks=[Clock()], peft_config=peft_config)
    trainer.train()
    out.close()


if __name__ == "__main__":
    main()
