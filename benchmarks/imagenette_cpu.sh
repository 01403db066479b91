#!/usr/bin/env bash
# Accuracy + time per epoch on ../shared/data/imagenette-subset (10 classes, 2,000 train / 500 val JPEGs):
# ResNet-18 from scratch, 2 DDP ranks on CPU (gloo), 128 px for 8 epochs then 160 px for 8.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${TRAINSTACK_DATA:-../shared/data}/imagenette-subset
OUT=${OUT_DIR:-runs/imagenette_cpu}
exec .venv/bin/torchrun --nproc-per-node 2 -m trainer train --data-dir "$DATA" --model resnet18 \
  --image-size 160 --progressive-resize --progressive-min-size 128 --progressive-stages 2 \
  --batch-size 32 --epochs 16 --lr 0.05 --weight-decay 5e-4 --warmup-epochs 1 --scheduler onecycle --label-smoothing 0.1 \
  --num-workers 2 --checkpoint-dir "$OUT/checkpoints" --log-dir "$OUT/logs" --log-every-steps 10 --no-auto-resume
