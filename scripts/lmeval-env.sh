#!/usr/bin/env bash
# Creates the TEST-ONLY virtual environment with lm-evaluation-harness (tests/evals/test_lm_eval.py). It is never a
# dependency of inflight: lm_eval and what it brings (datasets, evaluate, sacrebleu, ...) live in their own venv,
# which sees the project venv's packages (torch, transformers) through a .pth file instead of installing them again.
# Idempotent: with its stamp file a second run only re-points the .pth at PROJECT_PYTHON's site-packages (the venv
# may be shared by checkouts: make keeps it in the user cache). Usage: scripts/lmeval-env.sh [VENV_DIR] [PROJECT_PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.cache/lmeval-venv}"
PROJECT_PY="${2:-${PROJECT_PY:-.venv/bin/python}}"
LM_EVAL_SPEC="${LM_EVAL_SPEC:-lm_eval==0.4.*}"
STAMP="$VENV/.inflight-lmeval-ready"
# the project's interpreter and site-packages: the new venv is built from the same Python and reads its packages
BASE_PY=$("$PROJECT_PY" -c "import sys; print(sys._base_executable)")
SITE=$("$PROJECT_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
test -x "$VENV/bin/python" || "$BASE_PY" -m venv "$VENV"
VSITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$SITE" > "$VSITE/inflight-project-venv.pth"  # appended after the venv's own site-packages: ours win
if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import lm_eval" 2>/dev/null; then
    echo "lm-eval test venv ready: $VENV"; exit 0
fi
"$VENV/bin/python" -m pip install -q "$LM_EVAL_SPEC"
"$VENV/bin/python" -c "import lm_eval, torch, transformers; print('lm_eval ready; torch', torch.__version__)"
touch "$STAMP"
echo "lm-eval test venv ready: $VENV"
