"""Model toolkit: a task-trained tokenizer and a small random causal LM that load via from_pretrained (build.py),
and real pretrained models fetched and converted to plain HF folders (fetch.py, gguf.py).

Names are imported on first use: `inflight get-model` on a cached folder must not pay for torch and transformers."""

__all__ = ["SIZES", "count_params", "make_model"]


def __getattr__(name: str):
    if name in __all__:
        from inflight.modelkit import build  # lazy: torch + transformers, which `get-model` on a ready folder skips

        return getattr(build, name)
    raise AttributeError(f"module 'inflight.modelkit' has no attribute {name!r}")
