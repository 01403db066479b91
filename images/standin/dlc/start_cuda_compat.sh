#!/bin/bash
# The stand-in's /usr/local/bin/start_cuda_compat.sh, written here from the DLC's scripts/docker/pytorch/
# start_cuda_compat.sh: with the CUDA forward-compatibility package installed (/usr/local/cuda/compat) and a
# driver older than the one that package carries, put the compat libraries first on LD_LIBRARY_PATH. The driver's
# version comes from /proc/driver/nvidia/version, else nvidia-smi; each step is reported on stdout, the new
# LD_LIBRARY_PATH included. The DLC's nvidia/cuda base installs the compat package; the stand-in has none (nor a
# driver), so here it always says "package not found".
compat=/usr/local/cuda/compat/libcuda.so.1
if [ -f "$compat" ]; then
    max_driver=$(readlink "$compat" | cut -d'.' -f 3-)
    echo "CUDA compat package should be installed for NVIDIA driver smaller than ${max_driver}"
    driver=$(sed -n 's/^NVRM.*Kernel Module *\([0-9.]*\).*$/\1/p' /proc/driver/nvidia/version 2>/dev/null || true)
    if [ -z "$driver" ]; then
        driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader --id=0 2>/dev/null || true)
    fi
    echo "Current installed NVIDIA driver version is ${driver}"
    if [ -n "$driver" ] && [ "$driver" != "$max_driver" ] \
        && [ "$driver" = "$(printf '%s\n%s\n' "$driver" "$max_driver" | sort -V | head -n1)" ]; then
        echo "Adding CUDA compat to LD_LIBRARY_PATH"
        export LD_LIBRARY_PATH=/usr/local/cuda/compat:$LD_LIBRARY_PATH
        echo "$LD_LIBRARY_PATH"
    else
        echo "Skipping CUDA compat setup as newer NVIDIA driver is installed"
    fi
else
    echo "Skipping CUDA compat setup as package not found"
fi
