#!/usr/bin/env bash
# The GPU bench (one GPU, <= 8 minutes, no internet; docs/backends.md "How to run on a lent GPU").
#   scripts/gpu-bench.sh                              # every stage: engine, trainer, push, pipeline
#   scripts/gpu-bench.sh --stages engine,trainer      # a subset
#   scripts/gpu-bench.sh --set server.max_batch=512   # any server.* / trainer.* option of the run config
#   scripts/gpu-bench.sh --device cpu --tiny          # every stage small on CPU: a dry run of the script (~2 min)
# PYTHON: the interpreter (default .venv/bin/python, else python3); OUT: where figures and logs go (runs/gpu-bench).
# Writes OUT/bench.json (each figure {"value", "goal", "met", "context"}, stage seconds and errors) and OUT/bench.log;
# exits non-zero naming the failed stage(s). Stages and figures: scripts/gpu_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu-bench}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
set +e
"$PYTHON" scripts/gpu_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
set -e
echo "figures: $OUT/bench.json   log: $OUT/bench.log   exit $rc"
exit "$rc"
