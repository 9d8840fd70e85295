#!/usr/bin/env bash
# The first thing to run on a GPU (one GPU, < 8 minutes; docs/backends.md). No internet needed.
#   scripts/gpu-smoke.sh                       # uses .venv (CUDA torch + inflight: `make install`)
#   PYTHON=/path/python VLLM_PYTHON=/path/vllm-python scripts/gpu-smoke.sh
#   scripts/gpu-smoke.sh --device cpu --tiny   # the same stages on CPU, small: a dry run of the script itself
# Stages (scripts/gpu_smoke.py): models, trainer (FSDP2 world 1, packed 16k step, checkpoint), server (built-in on
# CUDA bf16: conformance, 64/256 streams, 5 pushes under load + a file push, logprobs vs HF), train (6 steps of
# `inflight train`), vllm (if vLLM imports: VLLM_PYTHON, or .cache/gpu-venv from scripts/vllm-gpu-env.sh).
# Writes OUT/smoke.json (figures) and OUT/smoke.log; exits non-zero naming the failed stage.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu-smoke}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
if [ -z "${VLLM_PYTHON:-}" ] && [ -x .cache/gpu-venv/bin/python ]; then VLLM_PYTHON=.cache/gpu-venv/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# each server runs in a session of its own and is stopped as a process group (vLLM's engine core included) when
# its stage ends, fails or is interrupted (Ctrl-C, SIGTERM: gpu_smoke.py turns both into a clean exit)
set +e
"$PYTHON" scripts/gpu_smoke.py --out "$OUT" ${VLLM_PYTHON:+--vllm-python "$VLLM_PYTHON"} "$@" 2>&1 | tee "$OUT/smoke.log"
rc=${PIPESTATUS[0]}
set -e
echo "figures: $OUT/smoke.json   log: $OUT/smoke.log   exit $rc"
exit "$rc"
