"""`inflight serve --engine sglang`: a stock SGLang server started with the flags inflight needs (launcher.py);
backend.py registers it (inflight/backends.py)."""
