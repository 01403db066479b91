#!/usr/bin/env bash
# Every GPU figure of the project in one command (benchmarks/gpu_suite.py lists the steps):
#   bash benchmarks/gpu_suite.sh --device cuda --data DIR --out DIR     (about 8 minutes on one H100)
#   bash benchmarks/gpu_suite.sh --device cpu --small                   (the CPU check that it runs through)
# DIR for --data holds imagenette-subset, rid-roofs and video-clips (../shared/data; carry them to a GPU machine).
# Writes OUT/gpu_suite.md (one Markdown table to paste into docs/benchmarks.md) and one log per step.
# On CUDA it first builds our deformable-attention op for this GPU when it is not built yet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
if [[ " $* " == *" --device cuda "* ]] || [[ " $* " != *" --device "* ]]; then
  if ! PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "from trainer.ops import msda; import sys; sys.exit(0 if msda.load_extension() else 1)" 2>/dev/null; then
    arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" MAX_JOBS=${MAX_JOBS:-16} PYTHON="$PY" bash images/build_msda.sh
  fi
fi
exec env PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/gpu_suite.py "$@"
