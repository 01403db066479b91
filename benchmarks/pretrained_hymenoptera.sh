#!/usr/bin/env bash
# Fine-tuning from pretrained weights vs from scratch on ../shared/data/hymenoptera (ants vs bees, 245 train /
# 153 val photos), configs/hymenoptera.yaml as it is (ResNet-18, 128 px, 8 epochs, 2 DDP ranks on CPU).
# The "ImageNet-like" checkpoint is local, since no weights can be downloaded here: ResNet-18 trained by
# benchmarks/imagenette_cpu.sh on the imagenette subset (10 ImageNet classes, 2,000 photos; about 62 % top-1),
# exported with `python -m trainer export --format safetensors`; `--weights FILE` replaces its 10-class head.
# Prints the best and last val top-1 of both runs. Idle 2-vCPU machine: about 12 minutes (the pretraining 9).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-runs/pretrained_hymenoptera}
DATA=${TRAINSTACK_DATA:-../shared/data}
WEIGHTS=$OUT/imagenette-resnet18.safetensors
if [ ! -f "$WEIGHTS" ]; then
  OUT_DIR=$OUT/imagenette bash benchmarks/imagenette_cpu.sh
  .venv/bin/python -m trainer export --checkpoint "$OUT/imagenette/checkpoints" --format safetensors \
    --out "$OUT/imagenette-export"
  cp "$OUT/imagenette-export/model.safetensors" "$WEIGHTS"
fi
for run in scratch pretrained; do
  extra=()
  [ "$run" = pretrained ] && extra=(--weights "$WEIGHTS")
  .venv/bin/torchrun --nproc-per-node 2 -m trainer train --config configs/hymenoptera.yaml \
    --data-dir "$DATA/hymenoptera" --checkpoint-dir "$OUT/$run/checkpoints" --log-dir "$OUT/$run/logs" \
    --no-auto-resume "${extra[@]}"
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for run in ("scratch", "pretrained"):
    rows = [json.loads(l) for l in (Path(sys.argv[1]) / run / "logs" / "metrics.jsonl").read_text().splitlines()]
    top1 = [r["val_top1"] for r in rows if r.get("kind") == "epoch" and r.get("val_top1") is not None]
    print(f"{run}: val top-1 per epoch {', '.join(f'{v:.1f}' for v in top1)}; best {max(top1):.1f}, last {top1[-1]:.1f}")
PY
