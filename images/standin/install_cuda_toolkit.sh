#!/usr/bin/env bash
# A compiler-only CUDA toolkit laid out as the Deep Learning Container has it, from PyPI's NVIDIA wheels:
#   install_cuda_toolkit.sh PREFIX [PYTHON]
# PREFIX gets bin/ (nvcc, ptxas, ...), include/ (CUDA runtime, crt and CCCL headers), lib/ with a lib64 link and
# libcudart.so, nvvm/. No cuBLAS/cuSPARSE/cuSOLVER headers: the real base installs only `cuda-nvcc-13-3` and
# `cuda-cudart-devel-13-3` (aws/deep-learning-containers, docker/pytorch/Dockerfile.cuda, runtime-base stage;
# cuda_version 13.3.0 in .github/config/image/pytorch/2.13-sagemaker-cuda.yml). Used by images/standin/Containerfile
# (PREFIX /usr/local/cuda-13.3) and by `make test-image-torch` (PREFIX build/cuda-13.3), so CI builds the op
# against the same toolkit the stand-in has. Versions: CUDA_WHEELS below (override with the environment).
set -euo pipefail
prefix="${1:?usage: install_cuda_toolkit.sh PREFIX [PYTHON]}"
python="${2:-python3}"
# nvcc/crt/nvvm 13.3.73 (what `dnf install cuda-nvcc-13-3` gives: the newest 13.3 compiler), cudart 13.3.29 (the
# only 13.3 runtime on PyPI), CCCL 3.3 (the CCCL release of CUDA 13.3)
CUDA_WHEELS="${CUDA_WHEELS:-nvidia-cuda-nvcc==13.3.73 nvidia-cuda-crt==13.3.73 nvidia-nvvm==13.3.73 nvidia-cuda-runtime==13.3.29 nvidia-cuda-cccl==13.3.3.4.1}"
if [[ -x "$prefix/bin/nvcc" && -f "$prefix/.wheels" && "$(cat "$prefix/.wheels")" == "$CUDA_WHEELS" ]]; then
  echo "install_cuda_toolkit: $prefix up to date ($("$prefix/bin/nvcc" --version | tail -1))"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086  # CUDA_WHEELS is a list of requirement specifiers
PIP_CONFIG_FILE=/dev/null "$python" -m pip install -q --no-cache-dir --no-deps --target "$tmp" $CUDA_WHEELS
rm -rf "$prefix"
mkdir -p "$(dirname "$prefix")"
mv "$tmp/nvidia/cu13" "$prefix"
ln -sfn lib "$prefix/lib64"                                 # a toolkit's lib64, as CUDA_HOME users expect
ln -sf libcudart.so.13 "$prefix/lib/libcudart.so"           # the link the DLC adds for the NCCL OFI plugin
echo "$CUDA_WHEELS" > "$prefix/.wheels"
for h in cuda_runtime.h crt/host_config.h; do test -f "$prefix/include/$h" || { echo "install_cuda_toolkit: $prefix/include/$h missing" >&2; exit 1; }; done
for h in cublas_v2.h cusparse.h; do test ! -e "$prefix/include/$h" || { echo "install_cuda_toolkit: $h must not be in the toolkit" >&2; exit 1; }; done
echo "install_cuda_toolkit: $prefix: $("$prefix/bin/nvcc" --version | tail -1)"
