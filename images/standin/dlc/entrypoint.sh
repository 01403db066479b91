#!/bin/bash
# The stand-in's /usr/local/bin/entrypoint.sh, written here from the DLC's scripts/docker/pytorch/entrypoint.sh: the
# EC2 image's ENTRYPOINT, which the SageMaker image also copies but does not use (its ENTRYPOINT is
# start_with_right_hostname.sh). With the CUDA forward-compatibility package installed and a driver older than the
# one it carries (/proc/driver/nvidia/version, else nvidia-smi), the compat libraries go first on LD_LIBRARY_PATH,
# silently; then the command replaces the shell (exec "$@", arguments kept).
set -e
compat=/usr/local/cuda/compat/libcuda.so.1
if [ -f "$compat" ]; then
    max_driver=$(readlink "$compat" | cut -d'.' -f 3-)
    driver=$(sed -n 's/^NVRM.*Kernel Module *\([0-9.]*\).*$/\1/p' /proc/driver/nvidia/version 2>/dev/null || true)
    if [ -z "$driver" ]; then
        driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader --id=0 2>/dev/null || true)
    fi
    if [ -n "$driver" ] && [ -n "$max_driver" ] && [ "$driver" != "$max_driver" ] \
        && [ "$driver" = "$(printf '%s\n%s\n' "$driver" "$max_driver" | sort -V | head -n1)" ]; then
        export LD_LIBRARY_PATH=/usr/local/cuda/compat:${LD_LIBRARY_PATH}
    fi
fi
exec "$@"
