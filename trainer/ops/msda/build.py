"""Build the multi-scale deformable attention CUDA extension in place (``trainer/ops/msda/_C*.so``).

Run through ``images/build_msda.sh`` (CI, the Docker image and ``make`` use that one script). Needs a CUDA
build of torch and nvcc (``CUDA_HOME``); no GPU. Architectures come from ``TORCH_CUDA_ARCH_LIST`` (default
``8.0;8.6;9.0``: A100, A10G, H100/H200). Idempotent: when the .so exists and a stamp of the sources, torch
version, CUDA version and architecture list matches, it prints "up to date" and returns at once.

When the toolkit at ``CUDA_HOME`` lacks the cuBLAS/cuSPARSE headers that ATen's CUDA headers include (a
compiler-only toolkit), the headers shipped in the torch wheel's ``nvidia/*/include`` are added.

Exit status: 0 built or up to date; 1 build failed; 2 no CUDA torch or no nvcc (message says which).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
STAMP = HERE / ".build-stamp"
DEFAULT_ARCHS = "8.0;8.6;9.0"
SOURCES = ("csrc/msda.cpp", "csrc/msda_kernel.cu")


def built_library() -> Path | None:
    """Path of the built extension in this folder, or None."""
    found = sorted(HERE.glob("_C*.so")) + sorted(HERE.glob("_C*.pyd"))
    return found[0] if found else None


def built_arch_list() -> str | None:
    """TORCH_CUDA_ARCH_LIST of the current build (from the stamp), or None when not built."""
    parts = STAMP.read_text().split() if STAMP.is_file() and built_library() else []
    return parts[1] if len(parts) > 1 else None


def fingerprint(archs: str) -> str:
    """SHA-256 of the sources, this script, torch/CUDA versions and the architecture list."""
    import torch

    h = hashlib.sha256()
    for path in sorted(HERE.glob("csrc/*")) + [Path(__file__).resolve()]:
        h.update(path.name.encode() + path.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{archs}".encode())
    return h.hexdigest()


def extra_include_dirs(cuda_home: str) -> list[str]:
    """The wheel's CUDA library headers when the toolkit at ``cuda_home`` lacks cusparse.h/cublas_v2.h."""
    if all(os.path.isfile(os.path.join(cuda_home, "include", h)) for h in ("cusparse.h", "cublas_v2.h")):
        return []
    try:
        import nvidia  # namespace package of the CUDA runtime wheels that torch depends on
    except ImportError:
        return []
    dirs: list[str] = []
    for root in nvidia.__path__:
        for header in ("cusparse.h", "cublas_v2.h"):
            dirs += [os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "include", header))]
    return sorted(set(dirs))


def build(force: bool = False) -> int:
    """Compile the extension into this folder unless it is up to date; returns an exit status."""
    import torch
    from torch.utils import cpp_extension

    archs = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    if torch.version.cuda is None:
        print(
            f"build_msda: torch {torch.__version__} is a CPU build; the CUDA op needs a CUDA build of torch "
            "(CPU images skip this step and use the PyTorch reference)",
            file=sys.stderr,
        )
        return 2
    if cpp_extension.CUDA_HOME is None:
        print(
            f"build_msda: nvcc not found; set CUDA_HOME to a CUDA toolkit matching torch (CUDA {torch.version.cuda})",
            file=sys.stderr,
        )
        return 2
    stamp = fingerprint(archs)
    lib = built_library()
    if not force and lib and STAMP.is_file() and STAMP.read_text().split()[:1] == [stamp]:
        print(f"build_msda: up to date ({lib.relative_to(REPO)}, TORCH_CUDA_ARCH_LIST={archs})")
        return 0
    includes = extra_include_dirs(cpp_extension.CUDA_HOME)
    n_arch = len([a for a in archs.replace(" ", ";").split(";") if a])
    threads = max(1, min(n_arch, os.cpu_count() or 1))
    print(
        f"build_msda: compiling for TORCH_CUDA_ARCH_LIST={archs} with nvcc from {cpp_extension.CUDA_HOME}"
        + (f", extra includes {includes}" if includes else ""),
        flush=True,
    )
    from setuptools import setup

    # ninja (when installed) compiles the sources in parallel, MAX_JOBS at a time; without it, one after another
    use_ninja = shutil.which("ninja") is not None

    ext = cpp_extension.CUDAExtension(
        name="trainer.ops.msda._C",
        sources=[str((HERE / s).relative_to(REPO)) for s in SOURCES],
        include_dirs=[str(HERE / "csrc"), *includes],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo", f"--threads={threads}"]},
    )
    cwd = os.getcwd()
    os.chdir(REPO)  # --inplace puts trainer.ops.msda._C at trainer/ops/msda/ relative to here
    try:
        STAMP.unlink(missing_ok=True)
        for old in HERE.glob("_C*.so"):
            old.unlink()
        # setuptools only compares source timestamps (not headers, flags or archs): always start clean
        shutil.rmtree(HERE / "build", ignore_errors=True)
        setup(
            name="trainstack-msda",
            ext_modules=[ext],
            cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=use_ninja)},
            script_args=[
                "-q",
                "build_ext",
                "--inplace",
                "--build-temp",
                str(HERE / "build"),
                "--build-lib",
                str(HERE / "build" / "lib"),
            ],
        )
    except (SystemExit, Exception) as e:  # setuptools reports compiler errors as SystemExit
        print(f"build_msda: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        os.chdir(cwd)
    lib = built_library()
    if lib is None:
        print("build_msda: FAILED: no _C*.so produced", file=sys.stderr)
        return 1
    STAMP.write_text(f"{stamp} {archs.replace(' ', ';')}\n")  # fingerprint, then the arch list built for
    print(f"build_msda: built {lib.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(build(force="--force" in sys.argv[1:]))
