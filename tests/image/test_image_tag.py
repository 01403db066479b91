"""The image tag says what is in the image: untracked files under the Dockerfile's COPY sources make it dirty, and
a later clean push of the same commit is not answered "already pushed" with the dirty image; the inputs a build
cannot use are refused before anything is built (exit 2, one line)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.cli import image, image_inputs
from infra.cli.session import CliError
from tests.infra_helpers import REPO

DOCKERFILE = """ARG BASE_IMAGE=scratch
FROM ${BASE_IMAGE}
ARG TORCH_CUDA_ARCH_LIST="8.0"
WORKDIR /opt/trainstack
COPY requirements-trainer.txt ./
COPY trainer trainer
COPY configs configs
"""


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env}
    ).stdout


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A committed repository with the training Dockerfile's shape: COPY of trainer/, configs/ and a file."""
    repo = tmp_path / "repo"
    for rel, text in {
        "images/training/Dockerfile": DOCKERFILE,
        "requirements-trainer.txt": "numpy\n",
        "trainer/__init__.py": "",
        "configs/digits.yaml": "epochs: 1\n",
        "docs/notes.md": "notes\n",
        ".gitignore": "*.pyc\n",
    }.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "c")
    return repo


def test_an_untracked_config_makes_the_tag_and_revision_dirty(checkout):
    clean = image.git_tag(checkout)
    assert len(clean) == 12 and "dirty" not in clean
    (checkout / "configs" / "mine.yaml").write_text("epochs: 99\n")
    dirty = image.git_tag(checkout)
    assert dirty.startswith(clean + "-dirty-") and image.vcs_revision(checkout).endswith(dirty[12:])
    (checkout / "configs" / "mine.yaml").write_text("epochs: 98\n")  # other content, another tag
    assert image.git_tag(checkout) not in (clean, dirty)
    (checkout / "configs" / "mine.yaml").write_text("epochs: 99\n")
    assert image.git_tag(checkout) == dirty  # the same content, the same tag


def test_untracked_files_the_image_does_not_copy_or_git_ignores_leave_the_tag_clean(checkout):
    clean = image.git_tag(checkout)
    (checkout / "docs" / "draft.md").write_text("not copied\n")
    (checkout / "trainer" / "x.pyc").write_bytes(b"ignored")
    assert image.untracked_copied(checkout) == []
    assert image.git_tag(checkout) == clean
    (checkout / "trainer" / "new_module.py").write_text("x = 1\n")
    assert image.untracked_copied(checkout) == ["trainer/new_module.py"]


def test_the_untracked_copied_folders_come_from_the_real_dockerfile():
    """The real Dockerfile's COPY sources (push-image's parser) hold configs/, catalog/ and trainer/."""
    sources = {src for src, _ in image.parse_dockerfile(REPO / image.DOCKERFILE)[1]}
    assert {"configs", "catalog", "trainer", "requirements-trainer.txt", "images/training/requirements-lock.txt"} <= (
        sources
    )


def test_a_clean_push_after_a_dirty_one_of_the_same_commit_builds(checkout, monkeypatch):
    """The dirty build was pushed under its own tag; the clean tree's tag is not in the repository, so push-image
    builds it instead of answering "already pushed" (which it did when untracked files left the tag clean)."""
    (checkout / "configs" / "mine.yaml").write_text("epochs: 99\n")
    pushed = {image.git_tag(checkout)}  # what the registry holds after the dirty push
    (checkout / "configs" / "mine.yaml").unlink()
    built = []

    class FakeBuilder:
        kind = "docker"

        def login(self, *a, **k):
            pass

        def build(self, repo, dockerfile, tag, args, mounts):
            built.append(tag)

        def push(self, tag, tls_verify=True):
            return "sha256:" + "0" * 64

    class Outputs:
        repository_name, repository_uri = "trainstack", "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack"

    class Ecr:
        def get_authorization_token(self):
            return {"authorizationData": [{"authorizationToken": "QVdTOnB3"}]}

    monkeypatch.setattr(image, "tagged_digest", lambda ecr, repo, tag: "sha256:1" if tag in pushed else None)
    monkeypatch.setattr(image.oci, "find", lambda binary: FakeBuilder())
    aws = type("Aws", (), {"region": "us-east-1"})()
    out = image.push_image(aws, Outputs, checkout, ecr_in=lambda region: Ecr(), dockerfile="images/training/Dockerfile")
    assert "already pushed" not in out and built == [f"{Outputs.repository_uri}:{image.git_tag(checkout)}"]
    assert "dirty" not in built[0]


@pytest.mark.parametrize("tag", ["", "-x", ".x", "a/b", "a:b", "x" * 129, "sp ace"])
def test_a_bad_tag_is_refused(tag):
    with pytest.raises(CliError, match="not an image tag") as e:
        image_inputs.check_tag(tag)
    assert e.value.code == 2 and "\n" not in str(e.value)


@pytest.mark.parametrize("archs", ["8.0;8.6;9.0", "9.0a", "8.6+PTX", "7.5 8.0", "Ampere;Hopper", "12.0;12.1a+PTX"])
def test_arch_lists_torch_and_nvcc_13_build_are_taken(archs):
    assert image_inputs.check_archs(archs) == archs


@pytest.mark.parametrize("archs,entry", [("7.0", "7.0"), ("8.0;6.1", "6.1"), ("Volta", "Volta"), ("9", "9"), ("sm_90", "sm_90"), ("10.7", "10.7")])  # fmt: skip
def test_arch_lists_that_would_fail_after_compiling_are_refused(archs, entry):
    """7.0 (Volta): CUDA 13's nvcc has no sm_70 (the op compiled for a minute before failing with no reason)."""
    with pytest.raises(CliError, match=f"{entry!r} is not an architecture") as e:
        image_inputs.check_archs(archs)
    assert e.value.code == 2


def test_a_missing_ca_bundle_is_refused(tmp_path):
    with pytest.raises(CliError, match=f"--ca-bundle {tmp_path / 'nope.pem'}: no such readable file"):
        image_inputs.check_ca_bundle(str(tmp_path / "nope.pem"))
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    assert image_inputs.check_ca_bundle(str(tmp_path / "ca.pem")) == str(tmp_path / "ca.pem")
    assert image_inputs.check_ca_bundle(None) is None


def test_too_little_space_in_tmpdir_is_refused_even_when_the_store_has_room(tmp_path, monkeypatch):
    """The store on one disk with room, TMPDIR on another with 2 GiB: refused, naming TMPDIR (the push used to
    end in ENOSPC there)."""
    store, tmp = tmp_path / "store", tmp_path / "tmp"
    store.mkdir(), tmp.mkdir()
    device = {store: 1, tmp: 2}
    free = {1: 500 * 2**30, 2: 2 * 2**30}
    monkeypatch.setattr(image_inputs, "_device", lambda path: device[path])
    monkeypatch.setattr(image_inputs.shutil, "disk_usage", lambda path: SimpleNamespace(free=free[device[path]]))
    image_inputs.check_free_space({str(store): 20.0})
    with pytest.raises(CliError, match=f"^{tmp}: 2.0 GiB free, the build and push need about 5 GiB there") as e:
        image_inputs.check_free_space({str(store): 20.0, str(tmp): 5.0})
    assert e.value.code == 2
    free[1] = 22 * 2**30  # two folders on one disk add up: 20 + 5 > 22
    device[tmp] = 1
    with pytest.raises(CliError, match=f"^{store} and {tmp}: 22.0 GiB free"):
        image_inputs.check_free_space({str(store): 20.0, str(tmp): 5.0})
