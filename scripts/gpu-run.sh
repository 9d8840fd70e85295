#!/usr/bin/env bash
# The GPU window in one command (docs/backends.md "How to run on a lent GPU"), on the lent machine, carrying .whl/
# (scripts/gpu-wheels.sh makes it here):
#   scripts/gpu-run.sh                           # every stage of the bench
#   scripts/gpu-run.sh --stages engine,trainer   # any scripts/gpu-bench.sh options
# 1. installs the carried wheels ($WHEELS, default .whl) into $SITE (default /tmp/site) and puts it on PYTHONPATH;
# 2. imports what the bench's stages import (scripts/gpu_imports.py): a missing package stops here, exit 4;
# 3. runs scripts/gpu-bench.sh in $WORK (default /tmp/gpu-bench; the model alone is 988 MB) so that everything ends
#    within LIMIT_S (default 570) seconds of the start;
# 4. copies to DEST (default $OUT, else runs/gpu-run) bench.json, bench.log, this script's log gpu-run.log, and
#    bench-files.tar.gz holding every JSON and log of the run (stages, servers, the pipeline's runs): four files.
# Exits with the bench's status (0: every stage reported all its figures), 3 if the wheels did not install, 4 if an
# import failed.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
LIMIT_S="${LIMIT_S:-570}"
DEST="${DEST:-${OUT:-runs/gpu-run}}"
WORK="${WORK:-/tmp/gpu-bench}"
SITE="${SITE:-/tmp/site}"
WHEELS="${WHEELS:-.whl}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$DEST" "$WORK"
export PYTHONUNBUFFERED=1

run() {
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl || { echo "gpu-run: the wheels in $WHEELS did not install"; return 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu-run: no wheels in $WHEELS (scripts/gpu-wheels.sh makes .whl where PyPI answers; carry it)"
  fi
  "$PYTHON" scripts/gpu_imports.py || { echo "gpu-run: an import failed; no bench run"; return 4; }
  # what is left, less the copying at the end (10 s); the driver's own start and summary take ~20 s of it
  local left=$((LIMIT_S - (SECONDS - START) - 10))
  echo "gpu-run: $((SECONDS - START)) s for wheels and imports; the bench gets $left s"
  OUT="$WORK" PYTHON="$PYTHON" timeout -k 10 "$left" bash scripts/gpu-bench.sh --budget-s "$((left - 25))" "$@"
}

set +e
run "$@" 2>&1 | tee "$WORK/gpu-run.log"
rc=${PIPESTATUS[0]}
cp "$WORK/gpu-run.log" "$DEST/"
for f in bench.json bench.log; do
  [ -f "$WORK/$f" ] && cp "$WORK/$f" "$DEST/"
done
# the runs' role logs are 4 folders down; the models and checkpoints stay
(cd "$WORK" && find . -maxdepth 4 \( -name '*.json' -o -name '*.log' -o -name '*.jsonl' \) -not -path './model-*' \
  -not -path './arith-model*' -not -path '*/checkpoints/*' -print0 | tar -czf - --null -T -) >"$DEST/bench-files.tar.gz"
echo "gpu-run: exit $rc after $((SECONDS - START)) s; in $DEST: $(cd "$DEST" && echo *)"
exit "$rc"
