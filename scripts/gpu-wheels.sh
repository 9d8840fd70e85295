#!/usr/bin/env bash
# Wheels of inflight's dependencies that the lent GPU machine's image lacks (its packages: the list in
# docs/backends.md; no internet there), for CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored). Run it here,
# where PyPI answers; scripts/gpu-run.sh installs them there (docs/backends.md "How to run on a lent GPU"). Every
# NAME==VERSION below is the carry list that tests/test_gpu_imports.py rehearses the bench's imports with: a package
# the bench imports must be on the image's list or here. Versions: those this project is tested with. 4.7 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.3 \
  orjson==3.13.0 omegaconf==2.4.0 redis==8.2.0
ls -la .whl
du -sh .whl
