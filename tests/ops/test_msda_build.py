"""The CUDA extension built by images/build_msda.sh (``make test`` runs the build first, CI with one arch).

Skips with the command to run only when nothing was built; otherwise checks that the library loads on this
GPU-less machine, that its argument checks answer clearly, and that the script is idempotent. Without a build:
which CUDA library headers a compiler-only toolkit gets from the torch wheel and where ninja is found;
under `make test-image-torch`, that the op was built by the image's nvcc 13.3 against torch's CUDA 13.0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO

from tests import forkserver
from trainer.ops.msda import build as msda_build

BUILD_CMD = "TORCH_CUDA_ARCH_LIST=8.0 bash images/build_msda.sh"


@pytest.fixture(scope="module")
def library():
    lib = msda_build.built_library()
    if lib is None or msda_build.built_arch_list() is None:
        pytest.skip(f"msda extension not built: run `{BUILD_CMD}` (make test does) to compile and test it")
    return lib


def test_built_library_loads_and_checks_arguments(library):
    from trainer.ops import msda

    assert msda.load_extension() is not None, msda.extension_error()
    ext = msda.load_extension()
    assert ext.__file__ == str(library)
    value = torch.zeros(1, 2, 1, 4)
    shapes = torch.tensor([[1, 2]])
    starts = torch.zeros(1, dtype=torch.int64)
    loc = torch.zeros(1, 3, 1, 1, 2, 2)
    attn = torch.zeros(1, 3, 1, 1, 2)
    with pytest.raises(RuntimeError, match="msda: value must be a CUDA tensor"):
        ext.forward(value, shapes, starts, loc, attn, 64)
    with pytest.raises(RuntimeError, match="msda: value must be a CUDA tensor"):
        ext.backward(value, shapes, starts, loc, attn, torch.zeros(1, 3, 4), 64)


def test_build_script_is_idempotent(library):
    env = {**os.environ, "PYTHON": sys.executable, "TORCH_CUDA_ARCH_LIST": msda_build.built_arch_list()}
    t0 = time.monotonic()
    res = forkserver.run(["bash", "images/build_msda.sh"], cwd=REPO, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "build_msda: up to date" in res.stdout, res.stdout + res.stderr
    assert time.monotonic() - t0 < 60
    assert msda_build.built_library() == library


ATEN_NEEDS = ("cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h")


def _fake_include(root, files=(), folders=()):
    root.mkdir(parents=True)
    for name in files:
        (root / name).write_text(f"// {name}\n")
    for name in folders:
        (root / name).mkdir()
        (root / name / "inner.h").write_text("// inner\n")
    return root


def test_library_header_shim_links_only_what_the_toolkit_lacks_after_its_include(tmp_path):
    """A compiler-only toolkit (runtime headers, crt, CCCL; no cuBLAS/cuSPARSE/cuSOLVER) and the torch
    wheel's include folder of another CUDA minor: the shim links exactly the library headers the toolkit lacks
    (files and top-level folders), never a runtime header, and the compiler searches it after the toolkit, also for
    the runtime headers a linked library header includes by quoted name."""
    runtime = ["cuda_runtime.h", "cuda_runtime_api.h", "driver_types.h", "cuComplex.h", "cuda_fp16.h"]
    toolkit = _fake_include(tmp_path / "cuda" / "include", runtime, ["crt", "cccl", "nv", "cooperative_groups"])
    libraries = ["cublas_v2.h", "cublas_api.h", "cublasLt.h", "cusparse.h", "cusolverDn.h", "cusolver_common.h"]
    wheel = _fake_include(tmp_path / "w" / "cu13" / "include", runtime + libraries, ["crt", "nvtx3"])
    other = _fake_include(tmp_path / "w" / "nccl" / "include", ["nccl.h"])  # holds no header ATen needs: unused
    (wheel / "cublas_v2.h").write_text('#include "cublas_api.h"\n')
    (wheel / "cublas_api.h").write_text('#include "driver_types.h"\n#include "cuComplex.h"\n')
    for name in runtime:
        (wheel / name).write_text("#error the wheel's runtime header was read\n")
    # longer than the wheel's path, as trainer/ops/msda/build/ is: GCC then canonicalizes links in system folders
    shim_dir = tmp_path / "a-build-folder-whose-path-is-longer-than-the-wheel-include-folder" / "shim"
    shim = msda_build.library_header_shim(str(tmp_path / "cuda"), shim_dir, [str(other), str(wheel)])

    assert shim == shim_dir
    assert sorted(p.name for p in shim.iterdir()) == sorted([*libraries, "nvtx3"])
    for link in shim.iterdir():
        assert link.is_symlink() and link.resolve() == (wheel / link.name).resolve()
    assert not (shim / "cuda_runtime.h").exists() and not (shim / "crt").exists()

    flags = msda_build.shim_flags(shim)
    assert flags == {"cxx": [f"-I{shim}"], "nvcc": [f"-I{shim}"]}
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx:  # what the compiler searches and reads, as torch orders it: its -I folders, then extra arguments
        src = tmp_path / "probe.cpp"
        src.write_text("#include <cublas_v2.h>\n")
        res = subprocess.run(
            [cxx, "-E", "-v", "-H", "-x", "c++", str(src), "-o", os.devnull, f"-I{toolkit}", *flags["cxx"]],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert res.returncode == 0, res.stderr
        order = [line.strip() for line in res.stderr.splitlines() if line.startswith(" /")]
        assert order.index(str(toolkit)) < order.index(str(shim)), order
        read = [line.split(" ", 1)[1] for line in res.stderr.splitlines() if line.startswith(".")]
        assert read == [str(shim / "cublas_v2.h"), str(shim / "cublas_api.h")] + [
            str(toolkit / h) for h in ("driver_types.h", "cuComplex.h")
        ], read

    for h in ATEN_NEEDS:  # a full toolkit: nothing added
        (toolkit / h).write_text("")
    assert msda_build.library_header_shim(str(tmp_path / "cuda"), tmp_path / "shim2", [str(wheel)]) is None
    assert msda_build.shim_flags(None) == {"cxx": [], "nvcc": []}


def test_library_header_shim_is_not_made_when_the_toolkit_is_the_wheel(tmp_path):
    """CI's CUDA_HOME is the venv's nvidia/cu13 (nvcc wheel beside the library wheels): its include folder is the
    toolkit's own, so nothing is linked even without cuBLAS there."""
    cu13 = _fake_include(tmp_path / "cu13" / "include", ["cuda_runtime.h", "cublas_v2.h"])
    assert msda_build.library_header_shim(str(tmp_path / "cu13"), tmp_path / "shim", [str(cu13)]) is None
    assert not (tmp_path / "shim").exists()


def test_ninja_is_found_next_to_the_interpreter(tmp_path, monkeypatch):
    """PYTHON=/x/venv/bin/python bash images/build_msda.sh: the venv's bin/ (where `pip install ninja` puts it, as
    the image base has ninja 1.13.0) need not be on PATH."""
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "ninja").write_text("#!/bin/sh\necho 1.13.0\n")
    (venv_bin / "ninja").chmod(0o755)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert msda_build.find_ninja() == str(venv_bin / "ninja")
    assert shutil.which("ninja") == str(venv_bin / "ninja")  # torch runs `ninja` by name
    (venv_bin / "ninja").unlink()
    monkeypatch.setenv("PATH", str(empty))
    assert msda_build.find_ninja() is None


def test_built_by_the_image_toolkit_whose_cuda_minor_differs_from_torch():
    """`make test-image-torch` builds the op with the image base's compiler-only toolkit (nvcc 13.3, no cuBLAS
    headers, build/cuda-13.3) under the image's torch (CUDA 13.0 wheels) and sets TRAINSTACK_MSDA_EXPECT_CUDA=13.3:
    the build stamp records that nvcc, the toolkit has no cublas_v2.h, and the extension loads."""
    want = os.environ.get("TRAINSTACK_MSDA_EXPECT_CUDA")
    if not want:
        pytest.skip("TRAINSTACK_MSDA_EXPECT_CUDA unset: `make test-image-torch` sets it (13.3, the image's nvcc)")
    from torch.utils import cpp_extension

    from trainer.ops import msda

    cuda_home = cpp_extension.CUDA_HOME
    assert cuda_home, "no CUDA_HOME"
    assert msda_build.built_library() is not None, f"msda extension not built: run `{BUILD_CMD}`"
    built = msda_build.built_nvcc_version()
    assert built is not None and built.split(".")[:2] == want.split(".")[:2], (built, want)
    assert msda_build.nvcc_version(cuda_home).split(".")[:2] == want.split(".")[:2], cuda_home
    assert want.split(".")[:2] != torch.version.cuda.split(".")[:2], (want, torch.version.cuda)
    assert not os.path.exists(os.path.join(cuda_home, "include", "cublas_v2.h")), cuda_home
    assert msda.load_extension() is not None, msda.extension_error()
