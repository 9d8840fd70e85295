#!/usr/bin/env bash
# The environment of the vLLM backend on a GPU machine (scripts/gpu-check.sh, scripts/gpu-smoke.sh use it):
#   scripts/vllm-gpu-env.sh [VENV]     prints the venv's python on its last line
# - a vLLM already installed for the system python is used as is: the venv is made with --system-site-packages
#   (SYSTEM_SITE=1 forces that, SYSTEM_SITE=0 forbids it); otherwise vLLM is installed into the venv from wheels in
#   .whl/ (offline) or from the index;
# - inflight goes in with --no-deps (vLLM pins torch and transformers; pip must not touch them) and
#   --no-build-isolation (an isolated build would download setuptools: it fails offline), plus the few of inflight's
#   own dependencies vLLM does not bring (orjson), and pytest for the conformance suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${VENV:-.cache/gpu-venv}}"
PY="${PY:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm>=0.32,<0.34}"
EXTRA_DEPS=(orjson pytest pytest-timeout)

if [ -z "${SYSTEM_SITE:-}" ]; then
    if "$PY" -c "import vllm" 2>/dev/null; then SYSTEM_SITE=1; else SYSTEM_SITE=0; fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    if [ "$SYSTEM_SITE" = 1 ]; then "$PY" -m venv --system-site-packages "$VENV"; else "$PY" -m venv "$VENV"; fi
fi
V="$VENV/bin/python"
FIND=(); if ls .whl/*.whl >/dev/null 2>&1; then FIND=(--find-links .whl); fi
PIP=("$V" -m pip install -q "${FIND[@]}")
if ! "$V" -c "import vllm" 2>/dev/null; then
    if [ ${#FIND[@]} -gt 0 ]; then "${PIP[@]}" --no-index "$VLLM_SPEC"; else "${PIP[@]}" "$VLLM_SPEC"; fi
fi
"$V" -c "import setuptools" 2>/dev/null || "${PIP[@]}" "setuptools>=68"
for dep in "${EXTRA_DEPS[@]}"; do
    "$V" -c "import ${dep//-/_}" 2>/dev/null || "${PIP[@]}" "$dep"
done
"$V" -c "import inflight" 2>/dev/null || "${PIP[@]}" --no-deps --no-build-isolation -e .
"$V" -c "import vllm, orjson, inflight.engine.vllm_backend; print('vLLM', vllm.__version__)" >&2
echo "$V"
