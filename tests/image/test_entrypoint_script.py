"""images/training/entrypoint, the image's ENTRYPOINT, on this machine: the SageMaker hostname fix of the base's
start_with_right_hostname.sh (gethostname() -> current_host through a preloaded library) with every argument kept,
and nothing done outside a SageMaker job or for another command. The base's C source is images/standin/dlc's
(written from the DLC's changehostname.c), or the script's own two lines when the base has none. Needs gcc."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

ENTRYPOINT = REPO / "images" / "training" / "entrypoint"
DLC_SOURCE = REPO / "images" / "standin" / "dlc" / "changehostname.c"
# a `train` that reports what a trainer would see: the host name (as torchrun and NCCL ask for it) and its arguments
FAKE_TRAIN = (
    "#!/usr/bin/env python3\nimport json, socket, sys\nprint(json.dumps([socket.gethostname(), sys.argv[1:]]))\n"
)


@pytest.fixture
def job(tmp_path: Path) -> dict:
    """A SageMaker root with resourceconfig.json for algo-2 of 2, and a fake `train` first on PATH."""
    assert shutil.which("gcc"), "gcc is needed (the image's entrypoint compiles the hostname library)"
    (tmp_path / "ml" / "input" / "config").mkdir(parents=True)
    rc = {"current_host": "algo-2", "hosts": ["algo-1", "algo-2"], "network_interface_name": "eth0"}
    (tmp_path / "ml" / "input" / "config" / "resourceconfig.json").write_text(json.dumps(rc))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "train").write_text(FAKE_TRAIN)
    (tmp_path / "bin" / "train").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TRAINSTACK_CHANGEHOSTNAME_C")}
    env |= {
        "PATH": f"{tmp_path / 'bin'}:{env['PATH']}",
        "TRAINSTACK_SM_ROOT": str(tmp_path / "ml"),
        "TMPDIR": str(tmp_path),
    }
    return env


def run(env: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ENTRYPOINT), *argv], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("source", ["dlc", "own"])
def test_train_sees_its_sagemaker_host_name_and_keeps_every_argument(job, source):
    if source == "dlc":
        job["TRAINSTACK_CHANGEHOSTNAME_C"] = str(DLC_SOURCE)
    else:
        job["TRAINSTACK_CHANGEHOSTNAME_C"] = "/nonexistent/changehostname.c"  # a base without the file
    res = run(job, "train", "--config", "configs/p4d_resnet50.yaml", "--epochs", "1")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == ["algo-2", ["--config", "configs/p4d_resnet50.yaml", "--epochs", "1"]]
    assert "entrypoint: gethostname() -> algo-2 " in res.stderr


def test_outside_a_sagemaker_job_nothing_is_preloaded(job, tmp_path):
    (tmp_path / "ml" / "input" / "config" / "resourceconfig.json").unlink()  # EC2: `docker run IMAGE train ...`
    res = run(job, "train", "--data-dir", "/data/imagenet")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    host, args = json.loads(res.stdout)
    assert host == os.uname().nodename and args == ["--data-dir", "/data/imagenet"]


def test_other_commands_run_as_given_with_their_exit_status(job):
    res = run(job, "bash", "-c", 'echo "$0 $1"; exit 7', "a b", "c")
    assert (res.returncode, res.stdout, res.stderr) == (7, "a b c\n", "")


def test_a_host_name_that_is_not_one_is_refused_with_a_warning(job, tmp_path):
    rc = {"current_host": 'x"; rm -rf /', "hosts": ["x"]}
    (tmp_path / "ml" / "input" / "config" / "resourceconfig.json").write_text(json.dumps(rc))
    res = run(job, "train")
    assert res.returncode == 0
    assert json.loads(res.stdout)[0] == os.uname().nodename
    assert "is not a host name; gethostname() left as it is" in res.stderr


def test_without_a_compiler_the_job_still_starts_with_a_warning(job, tmp_path):
    (tmp_path / "nogcc").mkdir()
    (tmp_path / "nogcc" / "python3").symlink_to(os.path.realpath(sys.executable))
    for tool in ("bash", "env", "mktemp", "head"):
        (tmp_path / "nogcc" / tool).symlink_to(shutil.which(tool))
    job["PATH"] = f"{tmp_path / 'bin'}:{tmp_path / 'nogcc'}"
    res = run(job, "train", "--x")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[1] == ["--x"]
    assert "could not compile" in res.stderr and "gethostname() left as it is" in res.stderr
