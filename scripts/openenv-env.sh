#!/usr/bin/env bash
# Creates the TEST-ONLY virtual environment with openenv-core (tests/openenv_task/: OpenEnv environment servers and the
# task.name=openenv client). It is never a dependency of inflight: openenv-core brings gradio, fastmcp and a newer
# mcp, which live in this venv only. The venv sees the project venv's packages (torch, transformers, pytest,
# inflight itself) through a .pth file that adds the project's site-packages after its own (`venv
# --system-site-packages` cannot: it would add the base interpreter's packages, not the project venv's).
# Idempotent: with its stamp file a second run only re-points the .pth at PROJECT_PYTHON's site-packages (the venv
# may be shared by checkouts: make keeps it in the user cache). Usage: scripts/openenv-env.sh VENV_DIR PROJECT_PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.cache/openenv-venv}"
PROJECT_PY="${2:-${PROJECT_PY:-.venv/bin/python}}"
OPENENV_SPEC="${OPENENV_SPEC:-openenv-core==0.3.0}"
STAMP="$VENV/.inflight-openenv-ready"
BASE_PY=$("$PROJECT_PY" -c "import sys; print(sys._base_executable)")
SITE=$("$PROJECT_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
test -x "$VENV/bin/python" || "$BASE_PY" -m venv "$VENV"
VSITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir, not a bare path: the project venv's own .pth files (its editable install of inflight) apply too
echo "import site; site.addsitedir('$SITE')" > "$VSITE/inflight-project-venv.pth"
if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import openenv.core.env_server" 2>/dev/null; then
    echo "openenv test venv ready: $VENV"; exit 0
fi
"$VENV/bin/python" -m pip install -q "$OPENENV_SPEC"
"$VENV/bin/python" -c "import openenv.core.generic_client, inflight, torch; print('openenv-core ready')"
touch "$STAMP"
echo "openenv test venv ready: $VENV"
