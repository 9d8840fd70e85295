"""Held-out greedy accuracy on the arith task, computed the same way for every system (HF `generate`, greedy,
left-padded batches, the task's own verifier). Runs in inflight's venv and in each peer's venv: it needs only torch,
transformers and the repo on sys.path (inflight.tasks imports pydantic, nothing heavier)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inflight.tasks import TaskConfig, get_task  # noqa: E402
from inflight.modelkit.greedy import greedy_accuracy as _greedy  # noqa: E402

PROMPT = "{expr}="  # the short prompt the warm start and every compared run use


def arith_task(eval_size: int = 200):
    return get_task(TaskConfig(name="arith", digits=2, terms=2, operators=["+"], eval_size=eval_size, prompt=PROMPT))


def greedy_accuracy(model, tokenizer, task, max_new_tokens: int = 12, batch_size: int = 200) -> float:
    """The task's held-out split, scored the same way for every system (inflight's own helper)."""
    return _greedy(model, tokenizer, task, task.eval_samples(), max_new_tokens, batch_size)


def main() -> None:
    """`python arith_eval.py MODEL_DIR...`: print the held-out greedy accuracy of each saved model, one per line."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    task = arith_task()
    for path in sys.argv[1:]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        print(greedy_accuracy(model, AutoTokenizer.from_pretrained(path), task), flush=True)


if __name__ == "__main__":
    main()
