"""Small-model toolkit: a task-trained tokenizer and a small random causal LM that load via from_pretrained."""

from inflight.modelkit.build import SIZES, count_params, make_model

__all__ = ["SIZES", "count_params", "make_model"]
