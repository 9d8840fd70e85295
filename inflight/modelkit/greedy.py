"""Held-out greedy accuracy of an HF model on a task: HF `generate`, left-padded batches, the task's own verifier;
a reply counts only when it ended (end-of-sequence token within max_new_tokens), as in inflight's evaluations.
Used by the SFT warm start and by the peer benchmarks (which run it in other venvs: it needs only torch,
transformers and this package's light modules)."""

from __future__ import annotations

from typing import Any

import torch

from inflight.contracts import TaskSample, Verdict
from inflight.modelkit.stops import stop_token_ids


def greedy_accuracy(model: Any, tokenizer: Any, task: Any, samples: list[TaskSample], max_new_tokens: int = 16,
                    batch_size: int = 256) -> float:
    """Share of `samples` whose greedy completion the task labels correct."""
    was_training = model.training
    model.eval()
    correct = 0
    stops = sorted(stop_token_ids(model.config, model.generation_config, tokenizer))  # as the engine stops
    try:
        for start in range(0, len(samples), batch_size):
            chunk = samples[start : start + batch_size]
            prompts = [tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
                       for s in chunk]
            enc = tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left",
                            return_tensors="pt").to(model.device)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=stops)
            for s, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
                finish = "stop" if any(t in stops for t in ids) else "length"
                if finish == "stop":  # generate pads after the end; the reply is what came before it
                    ids = ids[: next(i for i, t in enumerate(ids) if t in stops)]
                text = tokenizer.decode(ids, skip_special_tokens=True)
                correct += finish == "stop" and task.verify(text, s, finish).label == Verdict.correct
    finally:
        model.train(was_training)
    return correct / max(1, len(samples))
