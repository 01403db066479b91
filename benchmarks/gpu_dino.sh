#!/usr/bin/env bash
# Issue 23's GPU figures in one command, on a machine with one NVIDIA GPU (about 8 minutes on an H100), run from the
# repository root. Each step has its own time limit; logs and a summary under $OUT (default /tmp/gpu-dino-out).
#   DATA=DIR       folder holding facemask-coco/ (../shared/data on a developer machine; carry it to a GPU machine)
#   UPSTREAM=DIR   optional checkout of upstream DINO's op (../shared/gpu-check/upstream_msda), timed beside ours
#   PY=python3     the interpreter (the image's or .venv/bin/python)
# Steps: op build for this GPU (when missing), op tests, op table (ours / upstream / reference, fp32 and bf16),
# DINO-4scale R50 TrainStep at 800 px bf16: ms/step at batch 2/4/8 and the profiler counts (eager, then
# --compile), and the real loop on facemask (120 steps, batch 2) with GPU busy % from nvidia-smi.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DATA=${DATA:-../shared/data}
OUT=${OUT:-/tmp/gpu-dino-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [[ ! -d $DATA/facemask-coco ]]; then
  echo "error: DATA=$DATA holds no facemask-coco/ (set DATA to the folder that has it)" >&2
  exit 2
fi
step() {
  local name=$1 t=$2; shift 2
  echo "=== $name ($(date +%T), limit ${t}s)"
  local s=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name rc=$rc in $((SECONDS - s))s"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
if ! $PY -c "from trainer.ops import msda; import sys; sys.exit(0 if msda.load_extension() else 1)" 2>/dev/null; then
  arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  step build 300 env TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS=16 PYTHON="$PY" bash images/build_msda.sh
fi
step op_tests 150 $PY -m pytest -q -p no:cacheprovider tests/ops/test_msda_cuda.py tests/ops/test_msda_library.py
step op_table 300 $PY benchmarks/msda.py --dtypes fp32,bf16 --iters 10 ${UPSTREAM:+--upstream-src "$UPSTREAM"}
DINO=(benchmarks/dino_step.py --device cuda --model resnet50 --image-size 800 --precision bf16-mixed
  --data "$DATA/facemask-coco" --steps 5 --time-batches 2,4,8)
step dino_step 240 $PY "${DINO[@]}"
step dino_step_compiled 420 $PY "${DINO[@]}" --compile
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -lms 500 > "$OUT/smi.csv" 2>&1 &
smi=$!
t_start=$(date '+%Y/%m/%d %T')
step dino_train 240 $PY -m trainer train --config configs/dino_4scale_coco.yaml --data-dir "$DATA/facemask-coco" \
  --train-split train --val-split val --coco-annotations 'annotations/custom_{split}.json' --coco-images '{split}2017' \
  --batch-size 2 --epochs 1 --max-steps-per-epoch 120 --num-workers 8 --log-every-steps 20 --device cuda \
  --checkpoint-dir /tmp/gpu-dino/ck --log-dir /tmp/gpu-dino/logs --no-auto-resume
t_end=$(date '+%Y/%m/%d %T')
kill $smi 2>/dev/null
echo "GPU busy % during the real loop (nvidia-smi every 0.5 s, samples with memory in use):"
awk -F', ' -v a="$t_start" -v b="$t_end" 'NR > 1 && $1 >= a && $1 <= b && $2+0 > 1000 {u += $3; n++}
  END {if (n) printf "%.1f %% over %d samples\n", u/n, n}' "$OUT/smi.csv" | tee "$OUT/busy.txt"
grep -h "host_syncs_per_step\|^timed:" "$OUT"/dino_step*.log > "$OUT/summary.txt" 2>/dev/null
grep -h "images_per_s" "$OUT/dino_train.log" | tail -n 2 >> "$OUT/summary.txt"
echo "done in ${SECONDS}s; summary in $OUT/summary.txt"
