#!/usr/bin/env bash
# Build trainer/ops/msda's CUDA extension in place. The one build script: CI (make), the Docker image and
# developers run exactly this. No GPU needed; needs a CUDA build of torch and nvcc (CUDA_HOME).
#   TORCH_CUDA_ARCH_LIST  default "8.0;8.6;9.0" (A100, A10G, H100/H200); CI uses "8.0"
#   CUDA_HOME             toolkit root (default: /usr/local/cuda when it has bin/nvcc)
#   PYTHON                interpreter with torch (default: python3)
#   --force               rebuild even when up to date (otherwise a matching build returns at once)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;8.6;9.0}"
# torch guesses CUDA_HOME from `which nvcc`, which is wrong when nvcc on PATH is a wrapper script
if [[ -z "${CUDA_HOME:-}" && -x /usr/local/cuda/bin/nvcc ]]; then export CUDA_HOME=/usr/local/cuda; fi
exec "${PYTHON:-python3}" "$here/../trainer/ops/msda/build.py" "$@"
