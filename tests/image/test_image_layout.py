"""The training image's own file tree runs the trainer: the layout is built from the Dockerfile's ``COPY``
lines (parsed, never listed twice) into a temporary folder, which is then the ONLY source on the path
(``PYTHONPATH`` = that folder, working directory = that folder, as ``WORKDIR``/``ENV`` set them in the image).
In it: ``train --help``, ``python -m trainer train --help``, the build-time import check, and a tiny CPU job
through the entrypoint against a fake ``/opt/ml`` (exit 0, model exported)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, tiny_overrides
from test_entrypoint import make_root

from infra.cli import image
from tests import forkserver

DOCKERFILE = REPO / "images" / "training" / "Dockerfile"


def dockerignore_patterns() -> list[str]:
    """The build context's exclusions (.dockerignore), as fnmatch patterns."""
    return [
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]


def excluded(rel: str, patterns: list[str]) -> bool:
    """Whether the context path ``rel`` (or a folder above it) matches a .dockerignore pattern. Docker anchors
    patterns at the context root; only a leading ``**/`` matches at any depth."""
    parts = rel.split("/")
    for pat in patterns:
        deep = pat.startswith("**/")
        pat = pat.removeprefix("**/")
        for i in range(1, len(parts) + 1):
            if fnmatch.fnmatch("/".join(parts[:i]), pat):
                return True
            if deep and any(fnmatch.fnmatch("/".join(parts[j:i]), pat) for j in range(1, i)):
                return True
    return False


def parse_dockerfile(path: Path = DOCKERFILE) -> tuple[str, list[tuple[str, str]], dict]:
    """(WORKDIR, [(source, destination)] of every COPY, ENV) of the training Dockerfile: push-image's parser, the
    one that decides which folders make the image tag dirty."""
    return image.parse_dockerfile(path)


def build_layout(root: Path) -> Path:
    """Copy the build context into ``root`` as the Dockerfile's COPY lines place it; returns the WORKDIR
    inside ``root``. Files excluded by .dockerignore are left out, as ``docker build`` leaves them out."""
    workdir, copies, _ = parse_dockerfile()
    patterns = dockerignore_patterns()
    for src, dest in copies:
        source = REPO / src
        assert source.exists(), f"COPY {src}: missing from the build context"
        target = root / dest.lstrip("/")
        if source.is_dir():
            for dirpath, dirnames, filenames in os.walk(source):
                rel_dir = Path(dirpath).relative_to(REPO).as_posix()
                dirnames[:] = [d for d in dirnames if not excluded(f"{rel_dir}/{d}", patterns)]
                for name in filenames:
                    rel = f"{rel_dir}/{name}"
                    if excluded(rel, patterns):
                        continue
                    out = target / Path(rel).relative_to(src)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(REPO / rel, out)
        else:
            out = target / source.name if dest.endswith("/") else target
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, out)
    return root / workdir.lstrip("/")


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory) -> tuple[Path, dict]:
    """(WORKDIR of the image's file layout, the environment a container of the image would have)."""
    root = tmp_path_factory.mktemp("image")
    workdir = build_layout(root)
    _, _, image_env = parse_dockerfile()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(workdir)
    env["TRAINSTACK_SM_ROOT"] = str(root / "opt" / "ml")
    env["PYTHONDONTWRITEBYTECODE"] = image_env.get("PYTHONDONTWRITEBYTECODE", "1")
    # python3 of this venv stands in for the base image's; the image's bin/ comes first as ENV PATH puts it.
    env["PATH"] = os.pathsep.join([str(workdir / "bin"), str(Path(sys.executable).parent), env.get("PATH", "")])
    return workdir, env


def _run(cmd: list[str], workdir: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return forkserver.run(cmd, cwd=workdir, env=env, timeout=timeout)


def test_dockerfile_parser_sees_the_shipped_tree():
    workdir, copies, env = parse_dockerfile()
    assert workdir == "/opt/trainstack" and env["PYTHONPATH"] == workdir
    dests = {d + Path(s).name if d.endswith("/") else d for s, d in copies}  # COPY a b dir/ -> dir/a, dir/b
    assert {"/opt/trainstack/trainer", "/opt/trainstack/catalog", "/opt/trainstack/bin/train"} <= dests
    assert "/opt/trainstack/bin/entrypoint" in dests


def test_layout_holds_no_repository_only_code(image_tree):
    workdir, env = image_tree
    assert not (workdir / "infra").exists() and not (workdir / "tests").exists()
    res = _run([sys.executable, "-c", "import infra"], workdir, env)
    assert res.returncode != 0 and "No module named 'infra'" in res.stderr  # the repo is not on the path


def test_every_trainer_module_imports_in_the_image_tree(image_tree):
    workdir, env = image_tree
    res = _run([sys.executable, "-m", "trainer.check_install"], workdir, env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"from {workdir}/trainer" in res.stdout and f"catalog from {workdir}/catalog" in res.stdout
    print(res.stdout.strip())


def test_help_of_train_and_the_entrypoint(image_tree):
    workdir, env = image_tree
    for cmd in (
        ["train", "--help"],
        [sys.executable, "-m", "trainer", "train", "--help"],
        [sys.executable, "-m", "trainer.sagemaker.entrypoint", "--help"],
    ):
        res = _run(cmd, workdir, env)
        assert res.returncode == 0 and "--batch-size" in res.stdout, (cmd, res.stdout[-2000:] + res.stderr)


def test_train_without_arguments_runs_the_embedded_default(image_tree, tmp_path):
    """``python -m trainer train`` in the image, from another folder, trains configs/digits.yaml (capped here to
    one step) and writes where that file says, relative to the working directory."""
    workdir, env = image_tree
    res = forkserver.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "train",
            "--max-steps-per-epoch",
            "1",
            "--epochs",
            "1",
            "--warmup-epochs",
            "0",
        ],
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"config: {workdir}/configs/digits.yaml (the embedded default" in res.stdout
    import torch

    state = next((tmp_path / "runs" / "digits" / "checkpoints").glob("ckpt-*/state.pt"))
    cfg = torch.load(state, weights_only=True)["config"]
    assert (cfg["model"], cfg["image_size"], cfg["batch_size"]) == ("resnet18", 32, 64), cfg


def test_tiny_cpu_job_through_the_entrypoint(image_tree, tiny_digits, tmp_path):
    workdir, env = image_tree
    over = tiny_overrides(tiny_digits, tmp_path, epochs=1, max_steps_per_epoch=2)
    for key in ("checkpoint_dir", "log_dir", "data_dir"):
        over.pop(key)
    hps = {k: json.dumps(v) if isinstance(v, str) else str(v) for k, v in over.items()}
    root = make_root(tmp_path / "opt_ml", hps=hps, channels=())
    (root / "input" / "data").mkdir(parents=True)
    (root / "input" / "data" / "training").symlink_to(tiny_digits, target_is_directory=True)
    job_env = {**env, "TRAINSTACK_SM_ROOT": str(root), "TRAINSTACK_NPROC_PER_NODE": "1"}
    res = _run(["train"], workdir, job_env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    model = json.loads((root / "model" / "model.json").read_text())
    assert (root / "model" / model["checkpoint"] / "state.pt").is_file()
    assert not (root / "output" / "failure").exists()
