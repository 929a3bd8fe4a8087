#!/usr/bin/env bash
# One prepared run for a lent GPU machine (issue 29 part 4): build against the
# torch already installed there, run the CUDA tests, then bench/gpu_step.py.
# Everything it prints also lands in $OUT (the device tool brings it back).
# Usage there: bash bench/gpu_check.sh [pytest args...]
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 INFINITY_BUILD_JOBS=${INFINITY_BUILD_JOBS:-16}
PY=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  df -h /tmp | tail -1
} 2>&1 | tee "$OUT/machine.txt"
start=$(date +%s)
$PY -m pip install --quiet --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
timeout "${TEST_TIMEOUT:-260}" $PY -m pytest -q -m cuda -rs -p no:cacheprovider \
  --timeout 90 --junitxml "$OUT/junit.xml" tests/cuda "$@" 2>&1 | tee "$OUT/tests.log" | tail -60
echo "tests: $(( $(date +%s) - start )) s"
# Two batch sizes: launch-bound (4 x 512) and compute-bound (16 x 1024).
timeout "${BENCH_TIMEOUT:-170}" $PY bench/gpu_step.py --nvme-path /tmp \
  --rows host,host+eager,host+overlap,nvme,nvme+overlap 2>&1 | grep -v USDT | tee "$OUT/gpu_step.txt"
timeout "${BENCH_TIMEOUT:-170}" $PY bench/gpu_step.py --nvme-path /tmp --batch 16 --seq 1024 \
  --rows host,host+eager,host+overlap 2>&1 | grep -v USDT | tee "$OUT/gpu_step_large.txt"
echo "all: $(( $(date +%s) - start )) s"
