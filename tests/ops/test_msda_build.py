"""The CUDA extension built by images/build_msda.sh (``make test`` runs the build first, CI with one arch).

Skips with the command to run only when nothing was built; otherwise checks that the library loads on this
GPU-less machine, that its argument checks answer clearly, and that the script is idempotent.
"""

from __future__ import annotations

import os
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
