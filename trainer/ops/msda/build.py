"""Build the multi-scale deformable attention CUDA extension in place (``trainer/ops/msda/_C*.so``).

Run through ``images/build_msda.sh`` (CI, the Docker image and ``make`` use that one script). Needs a CUDA
build of torch and nvcc (``CUDA_HOME``); no GPU. Architectures come from ``TORCH_CUDA_ARCH_LIST`` (default
``8.0;8.6;9.0``: A100, A10G, H100/H200). Idempotent: when the .so exists and a stamp of the sources, torch
version, CUDA version, nvcc version and architecture list matches, it prints "up to date" and returns at once.

When the toolkit at ``CUDA_HOME`` lacks the cuBLAS/cuSPARSE/cuSOLVER headers that ATen's CUDA headers include
(a compiler-only toolkit, as the training image's base has), only those library headers are taken from the torch
wheel's ``nvidia/*/include``, searched after the toolkit's own (:func:`library_header_shim`). ninja, when found
on ``PATH`` or next to the interpreter running this script, compiles the sources in parallel.

Exit status: 0 built or up to date; 1 build failed; 2 no CUDA torch or no nvcc (message says which).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
STAMP = HERE / ".build-stamp"
DEFAULT_ARCHS = "8.0;8.6;9.0"
SOURCES = ("csrc/msda.cpp", "csrc/msda_kernel.cu")
SHIM = HERE / "build" / "cuda-library-headers"  # inside the build folder: git-ignored, removed before each build
# The CUDA library headers ATen's CUDA headers include (torch/include/ATen/cuda/CUDAContextLight.h and
# Exceptions.h, torch 2.13/2.14: cusparse.h, cublas_v2.h, cublasLt.h, cusolverDn.h; cudss.h only in USE_CUDSS builds)
ATEN_LIBRARY_HEADERS = ("cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h")


def built_library() -> Path | None:
    """Path of the built extension in this folder, or None."""
    found = sorted(HERE.glob("_C*.so")) + sorted(HERE.glob("_C*.pyd"))
    return found[0] if found else None


def _stamp_field(i: int) -> str | None:
    parts = STAMP.read_text().split() if STAMP.is_file() and built_library() else []
    return parts[i] if len(parts) > i else None


def built_arch_list() -> str | None:
    """TORCH_CUDA_ARCH_LIST of the current build (from the stamp), or None when not built."""
    return _stamp_field(1)


def built_nvcc_version() -> str | None:
    """Version of the nvcc that compiled the current build (from the stamp, e.g. ``13.3.73``), or None."""
    return _stamp_field(2)


def nvcc_version(cuda_home: str) -> str:
    """``$cuda_home/bin/nvcc --version``'s release, e.g. ``13.3.73`` (``V13.3.73``), or ``unknown``."""
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    found = re.search(r"\bV(\d+\.\d+(?:\.\d+)?)", out) or re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else "unknown"


def fingerprint(archs: str, nvcc: str = "") -> str:
    """SHA-256 of the sources, this script, torch/CUDA versions, the nvcc version and the architecture list."""
    import torch

    h = hashlib.sha256()
    for path in sorted(HERE.glob("csrc/*")) + [Path(__file__).resolve()]:
        h.update(path.name.encode() + path.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{nvcc}|{archs}".encode())
    return h.hexdigest()


def wheel_include_dirs() -> list[str]:
    """The ``include`` folders of the NVIDIA wheels torch depends on (``nvidia/*/include``), sorted."""
    try:
        import nvidia  # namespace package of the CUDA runtime wheels that torch depends on
    except ImportError:
        return []
    return sorted({d for root in nvidia.__path__ for d in glob.glob(os.path.join(root, "*", "include"))})


def library_header_shim(cuda_home: str, shim: Path = SHIM, wheel_includes: list[str] | None = None) -> Path | None:
    """A folder of links to the CUDA library headers that ATen needs and the toolkit lacks, or None.

    Inputs: the toolkit at ``cuda_home`` and the NVIDIA wheels' include folders (``wheel_includes``, default
    :func:`wheel_include_dirs`: torch's ``nvidia/cu13/include`` for CUDA 13 wheels). When
    ``$cuda_home/include`` has all of :data:`ATEN_LIBRARY_HEADERS`, nothing is needed and ``shim`` is not made.
    Otherwise ``shim`` (recreated) gets one symlink per file or top-level folder of each wheel include folder that
    holds one of the missing headers, for every name absent from ``$cuda_home/include`` (the first such wheel
    folder, in sorted order, wins a name): cuBLAS, cuSPARSE, cuSOLVER, cuFFT, cuRAND, nvrtc ... but never the
    CUDA runtime (``cuda_runtime.h``, ``crt/``, ``cuda_fp16.h`` ...), which the toolkit has.

    Why: the training image's base (AWS DLC pytorch 2.13.0-cu133) has a compiler-only CUDA 13.3 toolkit
    (``cuda-nvcc-13-3`` and ``cuda-cudart-devel-13-3``: no cuBLAS/cuSPARSE headers) under torch 2.13.0+cu130,
    whose wheel ships CUDA 13.0's. Putting the wheel's whole include folder on ``-I`` (searched before the
    toolkit's) made nvcc 13.3 read 13.0's runtime headers (``cuda_runtime_api.h``: ``CUDART_VERSION`` 13000), and
    the toolkit's CCCL stopped with ``#error "CUDA compiler and CUDA toolkit headers are incompatible"`` (issue
    48). The linked headers only declare the libraries torch itself links (its 13.0 wheels); the runtime headers
    they include by name resolve to the toolkit's. ``build`` searches the shim after the toolkit's include
    (:func:`shim_flags`).
    """
    inc = os.path.join(cuda_home, "include")
    missing = [h for h in ATEN_LIBRARY_HEADERS if not os.path.isfile(os.path.join(inc, h))]
    if not missing:
        return None
    present = set(os.listdir(inc)) if os.path.isdir(inc) else set()
    sources = [
        d
        for d in (wheel_include_dirs() if wheel_includes is None else wheel_includes)
        if os.path.realpath(d) != os.path.realpath(inc) and any(os.path.isfile(os.path.join(d, h)) for h in missing)
    ]
    if not sources:
        return None
    shutil.rmtree(shim, ignore_errors=True)
    shim.mkdir(parents=True)
    for src in sources:
        for name in sorted(os.listdir(src)):
            if name not in present and not (shim / name).is_symlink():
                (shim / name).symlink_to(os.path.join(os.path.abspath(src), name))
    return shim


def shim_flags(shim: Path | None) -> dict[str, list[str]]:
    """Compiler flags that search ``shim`` after the toolkit's include: ``{"cxx": [...], "nvcc": [...]}``.

    A plain ``-I`` among the extra compile arguments, which torch places after its own ``-I`` folders (torch's
    headers, then ``$CUDA_HOME/include``), so the toolkit's headers win any name; the shim holds none of them
    anyway. Not ``-idirafter`` (nor ``-isystem``), although nvcc forwards ``-Xcompiler=-idirafter...`` to every
    preprocessing pass: GCC's ``-fcanonical-system-headers`` (on by default) replaces the path of a header found in
    a system folder by its resolved one when that is shorter, so ``cublas_api.h``'s ``#include "driver_types.h"``
    then looked in the wheel's folder first and read CUDA 13.0's ``driver_types.h`` and ``cuComplex.h`` next to
    13.3's (seen with ``ninja -t deps`` in the image-torch build, nvcc 13.3.73, GCC 12.2). Found through ``-I``
    the link keeps its path, so such quoted includes look in the shim (no runtime headers there), then reach the
    toolkit through the ``-I`` chain.
    """
    if shim is None:
        return {"cxx": [], "nvcc": []}
    return {"cxx": [f"-I{shim}"], "nvcc": [f"-I{shim}"]}


def extra_include_dirs(cuda_home: str) -> list[str]:
    """``[shim]`` of :func:`library_header_shim` (for ``-I``, as ``benchmarks/msda.py`` passes it), or ``[]``.

    Ahead of the toolkit's include there (``extra_include_paths`` precede torch's) the shim is safe too: it holds
    no name the toolkit's include has, so nothing there is shadowed.
    """
    shim = library_header_shim(cuda_home)
    return [str(shim)] if shim else []


def find_ninja() -> str | None:
    """ninja on ``PATH``, else next to the running interpreter (a venv's ``bin/``, not on ``PATH`` when the
    build runs as ``PYTHON=/x/venv/bin/python bash images/build_msda.sh``), or None. torch runs ``ninja`` by
    name, so the interpreter's folder is put first on this process's ``PATH`` when ninja is found only there."""
    found = shutil.which("ninja")
    if found is None:
        found = shutil.which("ninja", path=os.path.dirname(sys.executable))
        if found:
            os.environ["PATH"] = os.path.dirname(found) + os.pathsep + os.environ.get("PATH", "")
    return found


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
    nvcc = nvcc_version(cpp_extension.CUDA_HOME)
    stamp = fingerprint(archs, nvcc)
    lib = built_library()
    if not force and lib and STAMP.is_file() and STAMP.read_text().split()[:1] == [stamp]:
        print(f"build_msda: up to date ({lib.relative_to(REPO)}, TORCH_CUDA_ARCH_LIST={archs})")
        return 0
    n_arch = len([a for a in archs.replace(" ", ";").split(";") if a])
    threads = max(1, min(n_arch, os.cpu_count() or 1))
    from setuptools import setup

    # ninja (when installed) compiles the sources in parallel, MAX_JOBS at a time; without it, one after another
    ninja = find_ninja()

    cwd = os.getcwd()
    os.chdir(REPO)  # --inplace puts trainer.ops.msda._C at trainer/ops/msda/ relative to here
    try:
        STAMP.unlink(missing_ok=True)
        for old in HERE.glob("_C*.so"):
            old.unlink()
        # setuptools only compares source timestamps (not headers, flags or archs): always start clean
        shutil.rmtree(HERE / "build", ignore_errors=True)
        shim = library_header_shim(cpp_extension.CUDA_HOME)  # after the clean: it lives in build/
        flags = shim_flags(shim)
        print(
            f"build_msda: compiling for TORCH_CUDA_ARCH_LIST={archs} with nvcc {nvcc} from {cpp_extension.CUDA_HOME}"
            f" (torch {torch.__version__}, {'ninja ' + ninja if ninja else 'no ninja'})"
            + (f", the CUDA library headers the toolkit lacks linked in {shim}" if shim else ""),
            flush=True,
        )
        ext = cpp_extension.CUDAExtension(
            name="trainer.ops.msda._C",
            sources=[str((HERE / s).relative_to(REPO)) for s in SOURCES],
            include_dirs=[str(HERE / "csrc")],
            extra_compile_args={
                "cxx": ["-O3", *flags["cxx"]],
                "nvcc": ["-O3", "-lineinfo", f"--threads={threads}", *flags["nvcc"]],
            },
        )
        setup(
            name="trainstack-msda",
            ext_modules=[ext],
            cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=ninja is not None)},
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
    STAMP.write_text(f"{stamp} {archs.replace(' ', ';')} {nvcc}\n")  # fingerprint, arch list, nvcc version
    print(f"build_msda: built {lib.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(build(force="--force" in sys.argv[1:]))
