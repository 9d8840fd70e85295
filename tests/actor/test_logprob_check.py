"""The float64 logprob check the live actor tests apply to every episode (tests/actor/helpers.py) separates a
correct engine from one whose completion positions are one off, on the same tiny model those tests serve. (Shifting
every position alike changes nothing: RoPE sees relative positions; the error is where the completion sits.)"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.actor.helpers import LOGPROB_TOL, assert_model_logprobs_float64, float64_logprobs


def episode(model_dir, seed: int, prompt: int, completion: int) -> SimpleNamespace:
    """An episode of random tokens, env tokens (loss mask 0) in the middle of the completion, with the logprobs a
    float32 forward gives (the engine's dtype on the tiny model)."""
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = [rng.randrange(model.config.vocab_size) for _ in range(prompt + completion)]
    mask = [0 if completion // 3 <= j < completion // 2 else 1 for j in range(completion)]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    completion = zip(ids[prompt:], mask, strict=True)
    logprobs = [lp[prompt + j - 1, t].item() if m else 0.0 for j, (t, m) in enumerate(completion)]
    return SimpleNamespace(prompt_ids=ids[:prompt], completion_ids=ids[prompt:], loss_mask=mask, logprobs=logprobs)


@pytest.mark.parametrize("seed,prompt,completion", [(0, 10, 12), (1, 30, 20), (2, 60, 40)])
def test_the_check_passes_a_correct_engine_and_fails_positions_one_off(tiny_model_dir, seed, prompt, completion):
    s = episode(tiny_model_dir, seed, prompt, completion)
    assert_model_logprobs_float64(tiny_model_dir, s)  # float32 with the right positions: rounding only
    for shift in (1, -1):
        off = float64_logprobs(tiny_model_dir, s, position_shift=shift)
        assert max(abs(a - b) for a, b in zip(off, float64_logprobs(tiny_model_dir, s), strict=True)) > 4 * LOGPROB_TOL
        it = iter(off)
        s_off = SimpleNamespace(**{**vars(s), "logprobs": [next(it) if m else 0.0 for m in s.loss_mask]})
        with pytest.raises(AssertionError, match="differ from the float64 forward"):
            assert_model_logprobs_float64(tiny_model_dir, s_off)

