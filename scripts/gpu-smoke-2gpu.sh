#!/usr/bin/env bash
# The two-GPU smoke (after scripts/gpu-smoke.sh passes; docs/backends.md): FSDP2 world 2, and weights over NCCL from
# a trainer on GPU 1 to a server on GPU 0 (built-in, `inflight train`, and vLLM if it imports).
#   scripts/gpu-smoke-2gpu.sh                        # OUT=runs/gpu-smoke-2gpu
#   scripts/gpu-smoke-2gpu.sh --device cpu --tiny    # a dry run on CPU (gloo everywhere)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu-smoke-2gpu}" exec scripts/gpu-smoke.sh --gpus 2 "$@"
