"""vLLM behind the inflight inference contract (docs/backends.md).

- backend.py: the registration (inflight/backends.py): launcher, option mapping, protocol, adapter.
- launcher.py: `inflight serve --engine vllm --model DIR [vLLM options]`: vLLM's `AsyncLLM` + inflight's HTTP layer.
- engine.py: `VLLMEngine`, the adapter that inflight's OpenAI endpoints drive (token ids, logprobs, exact versions).
- receiver.py: `/init_process_group`, `/request_weight_update` (validation, pause, rpc to the workers, version).
- worker_ext.py: the worker extension that joins the process group and loads the weights inside vLLM's workers.

Nothing here imports vLLM at import time: vLLM is never a dependency of inflight (it runs in its own environment).
"""
