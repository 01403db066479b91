#!/usr/bin/env bash
# DINO's GPU figures (step time, real loop, GPU busy) in one command, on a machine with one NVIDIA GPU (about 8
# minutes on an H100), run from the repository root. Each step has its own time limit; logs and a summary under
# $OUT (default /tmp/gpu-dino-out).
#   DATA=DIR       folder holding facemask-coco/ (../shared/data on a developer machine; carry it to a GPU machine)
#   UPSTREAM=DIR   optional checkout of upstream DINO's op (../shared/gpu-check/upstream_msda), timed beside ours
#   BASE=DIR       optional older checkout of this repository: its DINO step profiled beside this one (same GPU)
#   PROFILE=FILE   ../shared/gpu-check/dino_profile.py (ms/step at batch 2/4/8, profiler counts), run on both trees
#   STEPS=N        optimizer steps of each real-loop run (default 300, about one facemask epoch at batch 2)
#   BUDGET=SEC     stop starting steps once this many seconds have passed (default 540)
#   PY=python3     the interpreter (the image's or .venv/bin/python)
#   SKIP=a,b       step names not to run (e.g. SKIP=dino_step_compiled,dino_train_compiled when GPU minutes are few)
# Steps: op build for this GPU (when missing), op tests, op table (ours / upstream / reference, fp32 and bf16, wall
# and GPU time), DINO-4scale R50 TrainStep at 800 px bf16 (ms/step at batch 2/4/8 and on real facemask batches; the
# CPU proxy's counts and GPU kernel times), eager, --compile, then with the batched GPU matcher (`--matcher batched`),
# then with canvases + a static-size denoising part, eager and with CUDA graphs
# (the launches and syncs a graphed step leaves); the real loop on facemask (STEPS steps, batch 2) with GPU busy % from
# nvidia-smi: per-batch padding, fixed canvases (`--canvases auto`), canvases and a static-size denoising part
# (`--dn-max-boxes 100`), each eager then --compile, then canvases + static part with the batched matcher, with
# CUDA graphs (`--cuda-graphs`) and with both; then the matcher's and the graphs' CUDA tests; BASE's profile last.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DATA=${DATA:-../shared/data}
OUT=${OUT:-/tmp/gpu-dino-out}
STEPS=${STEPS:-300}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
extra_path=${PYTHONPATH:-}  # e.g. carried wheels installed with --target
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${extra_path:+:$extra_path}
if [[ ! -d $DATA/facemask-coco ]]; then
  echo "error: DATA=$DATA holds no facemask-coco/ (set DATA to the folder that has it)" >&2
  exit 2
fi
skipped() { [[ ",${SKIP:-}," == *",$1,"* ]] && echo "=== $1 skipped: SKIP"; }
step() {  # step NAME LIMIT CMD...: runs CMD under min(LIMIT, time left), log in $OUT/NAME.log
  local name=$1 t=$2; shift 2
  skipped "$name" && return 98
  local left=$((BUDGET - SECONDS))
  if ((left < 20)); then echo "=== $name skipped: budget spent"; return 99; fi
  ((t > left)) && t=$left
  echo "=== $name ($(date +%T), limit ${t}s)"
  local s=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$OUT/$name.log"
  echo "=== $name rc=$rc in $((SECONDS - s))s"
  return $rc
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
export TORCH_CUDA_ARCH_LIST=$arch  # the same flags for both loads of upstream's op (else it rebuilds)
if [[ -n ${UPSTREAM:-} ]]; then  # upstream's JIT build in the background, cached for the op table
  export TORCH_EXTENSIONS_DIR=/tmp/gpu-dino-ext
  MAX_JOBS=8 $PY -c "import sys; sys.path.insert(0, 'benchmarks'); import msda as b; \
b.build_upstream(b.upstream_source_dir('$UPSTREAM'))" > "$OUT/upstream_build.log" 2>&1 &
  up_pid=$!
fi
if ! $PY -c "from trainer.ops import msda; import sys; sys.exit(0 if msda.load_extension() else 1)" 2>/dev/null; then
  step build 300 env MAX_JOBS=16 PYTHON="$PY" bash images/build_msda.sh
fi
if [[ -n ${BASE:-} ]] && ! ls "$BASE"/trainer/ops/msda/_C*.so > /dev/null 2>&1; then
  cp trainer/ops/msda/_C*.so "$BASE/trainer/ops/msda/"  # same forward/backward bindings as BASE's kernels
fi
step op_tests 120 $PY -m pytest -q -x -p no:cacheprovider tests/ops/test_msda_cuda.py tests/ops/test_msda_library.py
if [[ -n ${up_pid:-} ]]; then
  wait "$up_pid"
  grep -q "upstream op built" "$OUT/upstream_build.log" || { echo "upstream build failed:"; tail -n 15 "$OUT/upstream_build.log"; UPSTREAM=""; }
fi
step op_table 150 $PY benchmarks/msda.py --dtypes fp32,bf16 --iters 20 ${UPSTREAM:+--upstream-src "$UPSTREAM"}
[[ -n ${PROFILE:-} ]] && step dino_profile 120 $PY "$PROFILE"
DINO=(benchmarks/dino_step.py --device cuda --model resnet50 --image-size 800 --precision bf16-mixed
  --data "$DATA/facemask-coco" --steps 5)
step dino_step 120 $PY "${DINO[@]}" --time-batches 2,4,8
step dino_step_compiled 180 $PY "${DINO[@]}" --time-batches 2 --compile
step dino_step_batched_matcher 120 $PY "${DINO[@]}" --time-batches 2 --matcher batched
STATIC=(--canvases auto --dn-max-boxes 100)
step dino_step_static 120 $PY "${DINO[@]}" --time-batches 2 "${STATIC[@]}"
step dino_step_graphs 150 $PY "${DINO[@]}" --time-batches 2 "${STATIC[@]}" --cuda-graphs
train() {  # train NAME [extra flags]: the real loop on facemask, GPU busy % (benchmarks/gpu_busy.py) into $OUT/NAME.busy
  local name=$1; shift
  skipped "$name" && return 0
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -lms 500 > "$OUT/$name.smi.csv" 2>&1 &
  local smi=$!
  step "$name" 240 $PY -m trainer train --config configs/dino_4scale_coco.yaml --data-dir "$DATA/facemask-coco" \
    --train-split train --val-split val --coco-annotations 'annotations/custom_{split}.json' \
    --coco-images '{split}2017' --batch-size 2 --epochs 1 --max-steps-per-epoch "$STEPS" --num-workers 8 \
    --log-every-steps 20 --device cuda --checkpoint-dir "/tmp/gpu-dino/$name/ck" --log-dir "/tmp/gpu-dino/$name/logs" \
    --no-auto-resume "$@"
  kill $smi 2>/dev/null
  echo "GPU busy % during $name (nvidia-smi every 0.5 s, samples with memory in use):"
  $PY benchmarks/gpu_busy.py "$OUT/$name.smi.csv" "$OUT/$name.log" | tee "$OUT/$name.busy"
}
train dino_train --canvases '' --dn-max-boxes 0
train dino_train_canvases --canvases auto --dn-max-boxes 0
train dino_train_compiled --canvases '' --dn-max-boxes 0 --compile
train dino_train_canvases_compiled --canvases auto --dn-max-boxes 0 --compile
train dino_train_static --canvases auto --dn-max-boxes 100
train dino_train_static_compiled --canvases auto --dn-max-boxes 100 --compile
train dino_train_static_batched_matcher --canvases auto --dn-max-boxes 100 --matcher batched
train dino_train_static_graphs --canvases auto --dn-max-boxes 100 --cuda-graphs
train dino_train_static_graphs_batched_matcher --canvases auto --dn-max-boxes 100 --cuda-graphs --matcher batched
# the CUDA tests of the batched matcher and the graphs after the figures (a short budget cuts them first)
step matcher_tests 120 $PY -m pytest -q -x -p no:cacheprovider tests/models/test_dino_matcher_batched.py
step graphs_tests 150 $PY -m pytest -q -x -p no:cacheprovider tests/models/test_dino_graphs.py
if [[ -n ${BASE:-} && -n ${PROFILE:-} ]]; then
  (cd "$BASE" && PYTHONPATH=$PWD${extra_path:+:$extra_path} step dino_profile_base 120 $PY "$PROFILE")
fi
{
  grep -h "^vs upstream" "$OUT/op_table.log"
  grep -h "ms/step\|GPU kernel time\|summed GPU" "$OUT"/dino_profile*.log
  grep -h "host_syncs_per_step\|^timed:\|GPU kernel time\|matcher" "$OUT"/dino_step*.log
  for f in "$OUT"/dino_train*.log; do echo "$f"; grep -h "images_per_s" "$f" | cut -c1-120; done
  cat "$OUT"/*.busy
} > "$OUT/summary.txt" 2>/dev/null
echo "done in ${SECONDS}s; summary in $OUT/summary.txt"
