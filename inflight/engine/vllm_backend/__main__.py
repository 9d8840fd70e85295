"""`python -m inflight.engine.vllm_backend --model DIR [vLLM options]` (run with vLLM's Python)."""

import sys

from inflight.engine.vllm_backend.launcher import main

sys.exit(main())
