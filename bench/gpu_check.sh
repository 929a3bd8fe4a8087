#!/usr/bin/env bash
# One prepared run for a lent GPU machine (issue 40): the product, not a sample.
# Every stage runs under its own timeout, and no stage starts past the budget
# (GPU_CHECK_BUDGET, default 470 s: the whole run ends within 8 minutes). One
# summary table at the end, also in $OUT/summary.md; every log in $OUT.
#
# Stages (GPU_STAGES, comma-separated; default all, in this order):
#   build      pip install --no-build-isolation --no-deps -e . against the torch there
#   tests      every `cuda`-marked test: the backend, NCCL, the jobs of
#              tests/fence/device_jobs.py on the GPU (generate, offloaded activations
#              bit for bit, the Trainer, LoRA, a resume in a fresh process) and the
#              sweep on cuda (every kept example and pinned case, SWEEP_DRAWN drawn)
#   train      the main job: `infinity train --steps 30` (its resident set by mapping at
#              exit in $OUT/rss_by_mapping.txt), the same with `--activations offload`,
#              and `--model DIR --data FILE` (a tiny Llama)
#   step       bench/gpu_step.py at 4 x 512 and 16 x 1024 tokens (plain, host, overlap; at
#              4 x 512 also the device budgets params+half and all-but-opt, and host
#              unclipped: what clipping costs), clipping 1.0
#   profile    the host row at 4 x 512 and at params+half under torch.profiler (host and
#              CUDA), top ops and CUDA runtime calls per row in $OUT/profile/: where the
#              host thread of a small-batch step goes, and why a larger budget is slower
#   traffic    bench/traffic_vs_plan.py: a step's host-device bytes against the plan
#   disk       the swap folder's rates: `infinity bench nvme`, and fio's fastest
#              engine where fio is installed (the NVMe rows' bound)
#   deepspeed  ZeRO-2 and ZeRO-3 CPU-offload rows on gpu_step's model and batches,
#              when deepspeed is importable or carried in .whl/ (../shared/gpu/README.md)
#
# CHECK_DEVICE=fence runs the same stages on a machine without a GPU (the fence
# device: the tests stage runs tests/fence, the step stage a small model on the
# CPU): how this script is tested before a GPU is lent.
# Usage there: bash bench/gpu_check.sh        e.g. GPU_STAGES=build,tests bash bench/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 INFINITY_BUILD_JOBS=${INFINITY_BUILD_JOBS:-16}
# NOTE: deterministic cuBLAS for the tests that compare bit for bit on the GPU.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8} HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
DEVICE=${CHECK_DEVICE:-cuda}
STAGES=",${GPU_STAGES:-build,tests,train,step,profile,traffic,disk,deepspeed},"
BUDGET=${GPU_CHECK_BUDGET:-470}
SCRATCH=$(mktemp -d /tmp/gpu-check-work.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
start=$(date +%s)
status=0
summary="$OUT/summary.md"
printf '| stage | result | seconds | what it says |\n|---|---|---|---|\n' >"$summary"

{
  command -v nvidia-smi >/dev/null && \
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  git log -1 --format='commit %h %s' 2>/dev/null
  df -h /tmp | tail -1
} 2>&1 | tee "$OUT/machine.txt"

# What a stage's log says, for its summary row (each reads the log named).
last_result() { grep -E 'passed|failed|error' "$1" | tail -1; }
train_losses() {
  $PY - "$1" <<'EOF'
import json, sys
events = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
start = next(e for e in events if e["event"] == "start")["lines"][0]
summary = next(e for e in events if e["event"] == "summary")
losses = list(summary["losses"].values())
print(f"{start[start.find('device '):][:70]}; loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
      f"held-out {summary['eval_before']:.3f} -> {summary['eval_after']:.3f}")
EOF
}
# each row's name, step seconds and ratio to plain (the whole table is in the log)
step_rows() { grep -hE '^ *(plain|host|nvme)' "$@" | awk '{print $1, $2, $3 "x"}'; }
first_lines() { grep -iE "$2" "$1" | head -3; }

# run_stage NAME LIMIT LOG DETAIL -- COMMAND...: COMMAND under `timeout`, capped by
# what is left of the budget; one summary row (DETAIL: a command reading the log).
run_stage() {
  local name=$1 limit=$2 log=$OUT/$3 detail=$4
  shift 5
  local left=$(( BUDGET - ($(date +%s) - start) ))
  if (( left < 20 )); then
    printf '| %s | not run: budget spent | 0 | |\n' "$name" >>"$summary"
    status=1
    return
  fi
  (( limit > left )) && limit=$left
  local t0 rc result
  t0=$(date +%s)
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) result=pass ;;
    124) result="TIMED OUT at ${limit} s"; status=1 ;;
    *) result="FAILED (exit $rc)"; status=1 ;;
  esac
  tail -n 12 "$log"
  printf '| %s | %s | %s | %s |\n' "$name" "$result" "$(( $(date +%s) - t0 ))" \
    "$(eval "$detail" 2>/dev/null | tr '\n|' '; ' | cut -c1-200)" >>"$summary"
}

wants() { [[ $STAGES == *,$1,* ]]; }

if wants build; then
  run_stage build 150 build.log "ls infinity/_C*.so infinity/_fence*.so" -- \
    $PY -m pip install --no-build-isolation --no-deps -e .
fi

if wants tests; then
  if [[ $DEVICE == cuda ]]; then
    # NOTE: a failing test saves the caching allocator's snapshot (tests/cuda/conftest.py),
    # one archive back: what was alive at a device peak the forecast missed.
    run_stage tests 230 tests.log "last_result $OUT/tests.log" -- \
      env INFINITY_CUDA_SWEEP_DRAWN="${SWEEP_DRAWN:-24}" \
      INFINITY_CUDA_MEMORY_SNAPSHOTS="$SCRATCH/snapshots" $PY -m pytest -q -m cuda -rs \
      -p no:cacheprovider --timeout 120 --junitxml "$OUT/junit.xml" tests/cuda
    if [[ -d $SCRATCH/snapshots ]]; then
      tar czf "$OUT/snapshots.tgz" -C "$SCRATCH" snapshots
    fi
  else
    run_stage tests 230 tests.log "last_result $OUT/tests.log" -- \
      env INFINITY_FENCE_TESTS=1 $PY -m pytest -q -p no:cacheprovider tests/fence
  fi
fi

if wants train; then
  common=(--device "$DEVICE" --json --eval-batches 2)
  # The first run also writes its resident set by mapping at exit (issue 41: what the
  # forecast of the resident set leaves out on CUDA).
  run_stage train 60 train.log "train_losses $OUT/train.log" -- \
    $PY bench/rss_by_mapping.py "$OUT/rss_by_mapping.txt" -- train --steps 30 "${common[@]}" --plot "$OUT/timeline.png" --nvme-path "$SCRATCH/nvme" \
    --checkpoint-dir "$SCRATCH/ckpt"
  run_stage train-offload 60 train_offload.log "train_losses $OUT/train_offload.log" -- \
    $PY -m infinity train --steps 30 --activations offload "${common[@]}" --plot none \
    --nvme-path "$SCRATCH/nvme2" --checkpoint-dir "$SCRATCH/ckpt2"
  $PY -c "import torch, transformers as t; torch.manual_seed(0); t.LlamaForCausalLM(t.LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4)).save_pretrained('$SCRATCH/tiny-llama')" >"$OUT/model.log" 2>&1
  run_stage train-model 60 train_model.log "train_losses $OUT/train_model.log" -- \
    $PY -m infinity train --model "$SCRATCH/tiny-llama" --data README.md --steps 20 \
    --seq-len 64 "${common[@]}" --plot none --output "$SCRATCH/tuned" --nvme-path "$SCRATCH/nvme3" \
    --checkpoint-dir "$SCRATCH/ckpt3"
fi

if wants step; then
  if [[ $DEVICE == cuda ]]; then
    # Two batch sizes: launch-bound (4 x 512) and compute-bound (16 x 1024).
    run_stage step 100 gpu_step.txt "step_rows $OUT/gpu_step.txt" -- $PY bench/gpu_step.py --nvme-path "$SCRATCH" \
      --rows host,host+noclip,host+overlap,nvme+overlap,host@params+half,host@all-but-opt,host@all
    run_stage step-large 80 gpu_step_large.txt "step_rows $OUT/gpu_step_large.txt" -- $PY bench/gpu_step.py \
      --nvme-path "$SCRATCH" --batch 16 --seq 1024 --rows host,host+overlap
  else
    run_stage step 100 gpu_step.txt "step_rows $OUT/gpu_step.txt" -- $PY bench/gpu_step.py --device cpu \
      --layers 2 --hidden 128 --vocab 512 --batch 2 --seq 64 --steps 3 --warmup 1 \
      --nvme-path "$SCRATCH" --rows host,host+noclip,nvme,host@params+half,host+overlap@all-but-opt,host@all
  fi
fi

if wants profile; then
  # One more run of two rows, profiled (the profiler slows the steps: their times are
  # not the step stage's). Tables: $OUT/profile/profile_<row>.txt.
  if [[ $DEVICE == cuda ]]; then
    run_stage profile 60 profile.txt "ls $OUT/profile" -- $PY bench/gpu_step.py --nvme-path "$SCRATCH" \
      --rows host,host@params+half --steps 2 --warmup 2 --profile "$OUT/profile"
  else
    run_stage profile 60 profile.txt "ls $OUT/profile" -- $PY bench/gpu_step.py --device cpu \
      --layers 2 --hidden 128 --vocab 512 --batch 2 --seq 64 --steps 2 --warmup 1 \
      --nvme-path "$SCRATCH" --rows host,host@params+half --profile "$OUT/profile"
  fi
fi

if wants traffic; then
  # Bytes a step moves against the plan, parameters in forward order and in registration
  # order (issue 43 part 4: the 1.26B Llama moved 1.40x the plan's host-to-device bytes).
  run_stage traffic 90 traffic.txt "grep -E '^ +(8|16) ' $OUT/traffic.txt | awk '{print \$1, \$3, \$5, \$6}'" -- \
    $PY bench/traffic_vs_plan.py --device "$DEVICE" --layers 8,16 --fractions 0.25
fi

if wants disk; then
  run_stage disk 45 nvme.txt "first_lines $OUT/nvme.txt 'recommend|best'" -- \
    $PY -m infinity bench nvme --path "$SCRATCH" --size 512MiB --block-sizes 1M,4M \
    --queue-depths 8,32 --repeats 1
  if command -v fio >/dev/null; then
    run_stage fio 45 fio.txt "first_lines $OUT/fio.txt 'read|write'" -- \
      $PY bench/nvme_vs_fio.py --path "$SCRATCH" --size 512MiB
  fi
fi

if wants deepspeed; then
  # NOTE: as ../shared/gpu/README.md says: DeepSpeed from carried wheels (.whl/),
  # installed apart from the project and run from a folder outside it, with the
  # rows script carried beside them.
  rows_script=$(ls "$PWD"/.whl/deepspeed_rows.py "$PWD"/../shared/gpu/deepspeed_rows.py 2>/dev/null | head -1)
  ds_env=()
  if ! $PY -c 'import deepspeed' >/dev/null 2>&1 && ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
    root=$PWD site=$SCRATCH/site
    mkdir -p "$site"
    (cd "$SCRATCH" && $PY -m pip install -q --no-index --no-deps --target "$site" "$root"/.whl/*.whl \
      && PYTHONPATH="$site" $PY -m pip install -q --no-index --no-deps --no-build-isolation \
      --target "$site" "$root"/.whl/deepspeed-*.tar.gz) >"$OUT/deepspeed_install.log" 2>&1
    ds_env=(PYTHONPATH="$site")
  fi
  if ! (cd "$SCRATCH" && env "${ds_env[@]}" $PY -c 'import deepspeed') >/dev/null 2>&1; then
    printf '| deepspeed | not run: not importable, and .whl/ carries none (../shared/gpu/README.md) | 0 | |\n' >>"$summary"
  elif [[ -z $rows_script ]]; then
    printf '| deepspeed | not run: deepspeed_rows.py is not in .whl/ | 0 | |\n' >>"$summary"
  else
    for mode in z2 z3; do
      run_stage "deepspeed-$mode" 120 "deepspeed_$mode.txt" "tail -1 $OUT/deepspeed_$mode.txt" -- \
        bash -c "cd '$SCRATCH' && env ${ds_env[*]} $PY '$rows_script' --mode $mode --batch 4 --seq 512"
    done
  fi
fi

echo
echo "== summary (all: $(( $(date +%s) - start )) s, budget $BUDGET s, device $DEVICE)"
cat "$summary"
exit $status
