"""Held-out greedy accuracy on the arith task, computed the same way for every system (HF `generate`, greedy,
left-padded batches, the task's own verifier). Runs in inflight's venv and in each peer's venv: it needs only torch,
transformers and the repo on sys.path (inflight.tasks imports pydantic, nothing heavier)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inflight.modelkit.greedy import greedy_accuracy as _greedy  # noqa: E402
from inflight.tasks import TaskConfig, get_task  # noqa: E402

PROMPT = "{expr}="  # the short prompt the warm start and every compared run use

# What every system is given, per preset: the task (prompts, verifier, held-out split), new tokens per completion,
# prompts x samples per optimizer step, sampling temperature, and inflight's config whose settings these match.
PRESETS = {
    # the demo's warm-started tiny model (bench/peers.py --setup), configs/cpu-demo.yaml
    "tiny": dict(model=".cache/peers/models/warm", task=dict(name="arith", digits=2, terms=2, operators=["+"], eval_size=200, prompt=PROMPT),
                 max_new_tokens=12, prompts_per_step=16, group_size=8, temperature=1.0, lr=3e-4,
                 config="configs/cpu-demo.yaml", sync_config="configs/cpu-sync.yaml", task_overrides=[
                     'task.prompt="{expr}="', "trainer.schedule=constant"]),  # a constant lr, as TRL's side
    # the real pretrained model (inflight get-model smollm2-135m-instruct), configs/cpu-smollm2.yaml
    "smollm2": dict(model=".cache/models/smollm2-135m-instruct", task=dict(name="arith", digits=2, terms=2, operators=["+"], eval_size=100,
                              answer_format="last_number",
                              system_prompt="You are a calculator. Reply with the result as a number."),
                    max_new_tokens=24, prompts_per_step=4, group_size=8, temperature=0.7, lr=2e-5,
                    config="configs/cpu-smollm2.yaml", sync_config="configs/cpu-smollm2.yaml",
                    task_overrides=["trainer.lora=null", "trainer.schedule=constant"]),  # full FT at one lr, as TRL
}
# the same with configs/cpu-smollm2.yaml's adapter (rank 8, alpha 16, every linear layer but the head) at its lr
PRESETS["smollm2-lora"] = dict(PRESETS["smollm2"], lr=2e-4, lora=dict(rank=8, alpha=16),
                               task_overrides=["trainer.schedule=constant"])


def arith_task(preset: str = "tiny"):
    return get_task(TaskConfig(**PRESETS[preset]["task"]))


def greedy_accuracy(model, tokenizer, task, max_new_tokens: int = 12, batch_size: int = 200) -> float:
    """The task's held-out split, scored the same way for every system (inflight's own helper)."""
    return _greedy(model, tokenizer, task, task.eval_samples(), max_new_tokens, batch_size)


def main() -> None:
    """`python arith_eval.py [--preset P] MODEL_DIR...`: print the held-out greedy accuracy of each saved model, one
    per line."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    args = sys.argv[1:]
    preset = "tiny"
    if args[:1] == ["--preset"]:
        preset, args = args[1], args[2:]
    task = arith_task(preset)
    for path in args:
        tok_from = path
        if (Path(path) / "adapter_config.json").exists():  # an inflight LoRA checkpoint: merged into its base
            from inflight.trainer.lora_export import base_of, merged_model

            tok_from, model = base_of(path), merged_model(path)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        print(greedy_accuracy(model, AutoTokenizer.from_pretrained(tok_from), task, PRESETS[preset]["max_new_tokens"]),
              flush=True)


if __name__ == "__main__":
    main()
