#!/usr/bin/env bash
# One prepared run for a lent GPU machine: build against the torch already
# installed there, then its stages (GPU_STAGES, comma-separated; default all):
#   tests  the CUDA tests (`make test-gpu`'s), TEST_TIMEOUT s (default 260)
#   step   bench/gpu_step.py at two batch sizes (issue 29 part 4), BENCH_TIMEOUT s each
#   part4  issue 26 part 4 (about 3 minutes; PART4_TIMEOUT s, default 240, a hard stop):
#          bench/state_dtype.py --scale-device cuda: a transformers Llama computing on
#          the GPU with its optimizer states pushed to the disk by a 2 GiB host budget
#          (PART4_HOST_MEMORY; the RAM would hold them), sized for the disk measured
#          first (the largest model up to PART4_PARAMS=1B whose fp32-moment step the
#          planner gives an I/O bound of PART4_IO_SECONDS=5 s), fp32 against int8
#          moments in interleaved rounds of the default and the overlapped step, no
#          round started past PART4_BUDGET=180 s. One line per run: step, NVMe bytes,
#          I/O bound, step / bound, GB/s over the step and while the disk is busy, and
#          int8's GB/s against fp32's of the same round (docs/BENCHMARKS.md, "int8
#          moments and the disk"). PART4_ARGS: more flags, which win (a CPU smoke of
#          the stage: PART4_ARGS="--scale-device cpu --scale-dtype fp32 --scale-vocab 256
#          --scale-seq-len 32 --scale-measure-size 8MiB --scale-device-memory 4MiB
#          --scale-host-memory 4MiB" PART4_PARAMS=8M PART4_IO_SECONDS=0.05).
#          If it fails or times out it says so and the script exits 1; the stages
#          before it keep their files. All three stages: about 6 minutes on an H100.
# Everything it prints also lands in $OUT (the device tool brings it back).
# Usage there: bash bench/gpu_check.sh [pytest args...]
#   e.g. GPU_STAGES=part4 bash bench/gpu_check.sh   (only the build and part 4)
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 INFINITY_BUILD_JOBS=${INFINITY_BUILD_JOBS:-16}
PY=${PYTHON:-python3}
STAGES=",${GPU_STAGES:-tests,step,part4},"
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  df -h /tmp | tail -1
} 2>&1 | tee "$OUT/machine.txt"
start=$(date +%s)
$PY -m pip install --quiet --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
if [[ $STAGES == *,tests,* ]]; then
  timeout "${TEST_TIMEOUT:-260}" $PY -m pytest -q -m cuda -rs -p no:cacheprovider \
    --timeout 90 --junitxml "$OUT/junit.xml" tests/cuda "$@" 2>&1 | tee "$OUT/tests.log" | tail -60
  echo "tests: $(( $(date +%s) - start )) s"
fi
if [[ $STAGES == *,step,* ]]; then
  # Two batch sizes: launch-bound (4 x 512) and compute-bound (16 x 1024).
  timeout "${BENCH_TIMEOUT:-170}" $PY bench/gpu_step.py --nvme-path /tmp \
    --rows host,host+eager,host+overlap,nvme,nvme+overlap 2>&1 | grep -v USDT | tee "$OUT/gpu_step.txt"
  timeout "${BENCH_TIMEOUT:-170}" $PY bench/gpu_step.py --nvme-path /tmp --batch 16 --seq 1024 \
    --rows host,host+eager,host+overlap 2>&1 | grep -v USDT | tee "$OUT/gpu_step_large.txt"
  echo "gpu_step: $(( $(date +%s) - start )) s"
fi
if [[ $STAGES == *,part4,* ]]; then
  # NOTE: its own folder, removed after: a timeout's kill leaves its swap files.
  dir=/tmp/infinity-part4
  timeout "${PART4_TIMEOUT:-240}" $PY bench/state_dtype.py --no-nvme-case --loss-steps 0 \
    --nvme-path "$dir" --scale-device cuda --scale-dtype bf16 --scale-dtypes fp32,int8 \
    --scale-params "${PART4_PARAMS:-1B}" --scale-io-seconds "${PART4_IO_SECONDS:-5}" \
    --scale-device-memory "${PART4_DEVICE_MEMORY:-4GiB}" \
    --scale-host-memory "${PART4_HOST_MEMORY:-2GiB}" \
    --scale-modes default,overlap --scale-rounds 2 --scale-steps 3 --scale-seq-len 256 \
    --scale-measure-size 512MiB --scale-budget-seconds "${PART4_BUDGET:-180}" --json \
    ${PART4_ARGS:-} \
    2>&1 | grep -v USDT | tee "$OUT/part4.txt" | grep -v '^{'
  rc=${PIPESTATUS[0]}
  rm -rf "$dir"
  if [[ $rc == 124 ]]; then
    echo "part4: TIMED OUT after ${PART4_TIMEOUT:-240} s (the lines above are the rounds that ended)"
  elif [[ $rc != 0 ]]; then
    echo "part4: FAILED (exit $rc; the error is above and in $OUT/part4.txt)"
  fi
  [[ $rc == 0 ]] || status=1
  echo "part4: $(( $(date +%s) - start )) s"
fi
echo "all: $(( $(date +%s) - start )) s"
exit $status
