"""Held-out greedy accuracy on the arith task, computed the same way for every system (HF `generate`, greedy,
left-padded batches, the task's own verifier). Runs in inflight's venv and in each peer's venv: it needs only torch,
transformers and the repo on sys.path (inflight.tasks imports pydantic, nothing heavier)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inflight.contracts import Verdict  # noqa: E402
from inflight.tasks import TaskConfig, get_task  # noqa: E402

PROMPT = "{expr}="  # the short prompt the warm start and every compared run use


def arith_task(eval_size: int = 200):
    return get_task(TaskConfig(name="arith", digits=2, terms=2, operators=["+"], eval_size=eval_size, prompt=PROMPT))


def greedy_accuracy(model, tokenizer, task, max_new_tokens: int = 12, batch_size: int = 200) -> float:
    import torch

    samples = task.eval_samples()
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, len(samples), batch_size):
                chunk = samples[start : start + batch_size]
                texts = [tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
                         for s in chunk]
                enc = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left",
                                return_tensors="pt").to(model.device)
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
                for s, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :].tolist()):
                    finish = "stop" if tokenizer.eos_token_id in ids else "length"
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    correct += task.verify(text, s, finish).label == Verdict.correct
    finally:
        model.train(was_training)
    return correct / max(1, len(samples))


def main() -> None:
    """`python arith_eval.py MODEL_DIR`: print the held-out greedy accuracy of a saved model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    print(greedy_accuracy(model, AutoTokenizer.from_pretrained(path), arith_task()))


if __name__ == "__main__":
    main()
