#!/usr/bin/env bash
# The prepared GPU run: DINO's real-loop throughput, the GPU decode, the checkpoint stall and the FFCV loader's
# figures in one device call (about 9.5 minutes on one H200), from the repository root with .gpu-carry/ carried
# (made here by `python3 benchmarks/gpu_carry.py`; docs/benchmarks.md "Waiting for a GPU" gives the exact device
# call). Steps, each under its own limit, the lists in benchmarks/gpu_prepared_run.py:
#   0. the carried wheels (ffcv 1.0.2 for Python 3.12 with its shared libraries, its pure-Python requirements,
#      torch-linear-assignment, faster-coco-eval) installed into /tmp/site, as the device README says; the
#      carried op build (when gpu_carry.py made one) copied in place, else gpu_dino.sh builds it (~40 s);
#   1. benchmarks/gpu_dino.sh: the synthetic step eager and graphed, the real loop (canvases + static denoising
#      part) eager, --matcher batched, --cuda-graphs and both, STEPS steps each, then their CUDA tests;
#   2-4. benchmarks/gpu_suite.sh --only the in-memory ResNet-50 rate, the checkpoint stall, --decode-device cuda
#      and seed 003's FFCV loader (trainer vs bare loop).
# Environment: BUDGET (seconds in all, default 540), DINO_BUDGET (default 280), STEPS (default 150), PART (all, or
# dino / suite: half of it, for two calls on a warm machine when one call's 10 minutes do not suffice), CARRY (default
# .gpu-carry), PY (default python3), WORK (the steps' logs and files, default /tmp/gpu-prepared-run), OUT (default
# $WORK/out). $OUT gets 4 files at the end (5 with console.log when the caller tees it there; a device call
# brings back 8 at most): prepared_run.md (each figure beside its goal), gpu_suite.md, summary.txt (gpu_dino.sh's)
# and logs.tar.gz (every step's log).
set -u
cd "$(dirname "$0")/.."
CARRY=${CARRY:-.gpu-carry}
WORK=${WORK:-/tmp/gpu-prepared-run}
OUT=${OUT:-$WORK/out}
BUDGET=${BUDGET:-540}
DINO_BUDGET=${DINO_BUDGET:-280}
PART=${PART:-all}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
[[ $PART != suite ]] && rm -rf "$WORK/dino"  # a second call (PART=suite) keeps the first one's DINO logs
[[ $PART != dino ]] && rm -rf "$WORK/suite"
mkdir -p "$WORK/dino" "$WORK/suite" "$OUT"
if [[ ! -d $CARRY/whl || ! -d $CARRY/data/facemask-coco || ! -d $CARRY/data/imagenette-subset ]]; then
  echo "error: CARRY=$CARRY lacks whl/ or data/: run python3 benchmarks/gpu_carry.py here and carry $CARRY" >&2
  exit 2
fi
ldd --version | head -1
pipi() { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
# ffcv's wheel is manylinux_2_35 (built on Debian 12): should pip refuse it there, the rest still runs (FFCV fails)
pipi "$CARRY"/whl/*.whl || { echo "warning: the wheels as one set did not install; without ffcv:" >&2
  pipi $(ls "$CARRY"/whl/*.whl | grep -v /ffcv-) || { echo "error: the carried wheels did not install" >&2; exit 2; }; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export TRAINSTACK_DATA=$(cd "$CARRY/data" && pwd)  # the CUDA tests' real data (matcher_tests reads facemask-coco)
$PY -c "import ffcv, numpy, torch; print('ffcv', ffcv.__file__, 'numpy', numpy.__version__, 'torch', torch.__version__)" \
  || echo "warning: ffcv does not import (above): ffcv_write and speed_ffcv will fail, the rest runs" >&2
if ls "$CARRY"/op/_C*.so > /dev/null 2>&1 && ! ls trainer/ops/msda/_C*.so > /dev/null 2>&1; then
  if [[ $($PY benchmarks/gpu_carry.py --op-sha) == "$(cat "$CARRY/op/SOURCES.sha256")" ]]; then
    cp "$CARRY"/op/_C*.so trainer/ops/msda/ && echo "op: the carried build"
  else
    echo "op: the carried build is of other sources; gpu_dino.sh builds it"
  fi
fi
skip=$($PY benchmarks/gpu_prepared_run.py --steps dino-skip)
only=$($PY benchmarks/gpu_prepared_run.py --steps suite)
if [[ $PART != suite ]]; then
  DATA=$CARRY/data STEPS=${STEPS:-150} BUDGET=$DINO_BUDGET PY=$PY OUT=$WORK/dino SKIP=$skip bash benchmarks/gpu_dino.sh
fi
if [[ $PART != dino ]]; then
  left=$((BUDGET - SECONDS - 15))  # 15 s kept for the summary and the tar
  PYTHON=$PY bash benchmarks/gpu_suite.sh --device cuda --data "$CARRY/data" --out "$WORK/suite" --only "$only" \
    --precisions bf16-mixed --budget "$left"
fi
head="prepared GPU run on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F), commit \
$(git rev-parse --short HEAD 2>/dev/null || echo '?'), \`bash benchmarks/gpu_prepared_run.sh\` (${SECONDS} s)"
$PY benchmarks/gpu_prepared_run.py --summary "$WORK" --head "$head"
cp "$WORK/prepared_run.md" "$WORK/suite/gpu_suite.md" "$WORK/dino/summary.txt" "$OUT/" 2> /dev/null
tar -czf "$OUT/logs.tar.gz" -C "$WORK" --exclude=suite/work dino suite
echo "done in ${SECONDS}s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
