#!/usr/bin/env bash
# Creates the TEST-ONLY virtual environment with verifiers 0.4 (tests/verifiers04). The project venv keeps verifiers
# 0.3.1 (the classic API, tests/tasks and tests/actor); this venv sees the project venv's packages (torch,
# transformers, inflight's editable install) through a .pth file and installs over them only what 0.4 needs that
# differs (verifiers 0.4, openai 2.x, mcp 2.x), plus uv, which 0.4's chat-loop harnesses run with. It then warms uv's
# cache with the harness program's packages, so a test's first episode does not download them.
# Idempotent: with its stamp file a second run only re-points the .pth at PROJECT_PYTHON's packages (the venv may be
# shared by checkouts: `make test-verifiers04` keeps it in the user cache).
# Usage: scripts/verifiers04-env.sh [VENV_DIR] [PROJECT_PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.cache/verifiers04-venv}"
PROJECT_PY="${2:-${PROJECT_PY:-.venv/bin/python}}"
VERIFIERS_SPEC="${VERIFIERS_SPEC:-verifiers==0.4.0}"
STAMP="$VENV/.inflight-verifiers04-ready"
BASE_PY=$("$PROJECT_PY" -c "import sys; print(sys._base_executable)")
SITE=$("$PROJECT_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
test -x "$VENV/bin/python" || "$BASE_PY" -m venv "$VENV"
VSITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# a site dir after the venv's own (ours win); addsitedir also reads its .pth files (inflight's editable install)
echo "import site; site.addsitedir('$SITE')" > "$VSITE/inflight-project-venv.pth"
if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(tuple(int(x) for x in m.version('verifiers').split('.')[:2]) < (0, 4))" 2>/dev/null; then
    echo "verifiers 0.4 test venv ready: $VENV"; exit 0
fi
"$VENV/bin/python" -m pip install -q "$VERIFIERS_SPEC" uv
"$VENV/bin/python" - <<'PY'
import subprocess, sys, tempfile
from pathlib import Path
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
with tempfile.TemporaryDirectory() as d:
    script = Path(d) / "chat.py"
    script.write_text(CHAT_PROGRAM_SOURCE)
    subprocess.run([str(Path(sys.executable).parent / "uv"), "sync", "--script", str(script), "-q", "--no-config"],
                   check=True)
import verifiers, openai, torch, transformers, inflight
print("verifiers", verifiers.__version__, "openai", openai.__version__, "torch", torch.__version__)
PY
touch "$STAMP"
echo "verifiers 0.4 test venv ready: $VENV"
