"""The pip layer's lock (images/training/requirements-lock.txt, written by images/training/lock.py): it covers
requirements-trainer.txt on the base's set, every entry pinned with hashes, no pre-release a dependency does not
demand, none of the base's torch family; the Dockerfile installs exactly it; the smoke's ``pip freeze`` check
names each package the image has at another version. No network: the lock is read, not resolved."""

from __future__ import annotations

import pytest
from conftest import REPO
from packaging.requirements import Requirement

from infra.cli import image
from infra.cli.smoke_checks import check_lock, lock_script
from infra.cli.smoke_hosts import SmokeFailure

lock = lock_script()
LOCKED = lock.read_lock(lock.LOCK.read_text())
BASE = lock.base_packages(lock.BASE_PACKAGES.read_text())


def test_the_lock_is_written_from_the_current_requirements_and_base():
    recorded = next(line for line in lock.LOCK.read_text().splitlines() if line.startswith("# inputs: "))
    now = lock.inputs_digest(lock.REQUIREMENTS.read_text(), lock.BASE_PACKAGES.read_text())
    assert recorded == f"# inputs: {now}", "requirements-trainer.txt or dlc-packages.txt changed: run make image-lock"


@pytest.mark.parametrize(
    "line",
    [ln.split("#")[0].strip() for ln in lock.REQUIREMENTS.read_text().splitlines() if ln.split("#")[0].strip()],
)
def test_every_requirement_is_locked_or_met_by_the_base(line):
    req = Requirement(line)
    name = lock.normalize(req.name)
    if name in LOCKED:
        assert req.specifier.contains(LOCKED[name][0], prereleases=True), (line, LOCKED[name])
    else:  # the layer leaves the base's own version, which must meet it
        assert name in BASE and req.specifier.contains(BASE[name], prereleases=True), (line, BASE.get(name))


def test_every_entry_is_pinned_with_hashes_and_nothing_of_the_base_torch_family():
    assert len(LOCKED) >= 20
    for name, (version, hashes) in LOCKED.items():
        assert version and hashes and all(len(h) == 64 for h in hashes), name
        assert BASE.get(name) != version, f"{name}=={version} is the base's own: not installed by the layer"
    assert not {"torch", "torchvision", "triton"} & LOCKED.keys()


def test_pre_releases_only_where_a_locked_package_pins_them():
    """The lock as written holds cwevals 0.0.1b1 (wandb 0.31.0 pins it) and OpenTelemetry's 0.66b2 halves (the
    1.45.2 packages pin them): projects with no final release. The rule refuses any other."""
    pinned = {"wandb": ("0.31.0", "", ["cwevals==0.0.1b1", "click>=8"]), "cwevals": ("0.0.1b1", "", [])}
    assert lock.unpinned_prereleases(pinned) == []
    chosen = {**pinned, "rich": ("15.0.0rc1", "", []), "mlflow": ("3.17.2", "", ['rich>=13; extra == "x"'])}
    assert lock.unpinned_prereleases(chosen) == ["rich==15.0.0rc1"]


def test_a_lock_entry_without_a_pin_or_hash_is_refused():
    with pytest.raises(ValueError, match="expected name==version with --hash"):
        lock.read_lock("numpy>=1.26 \\\n    --hash=sha256:" + "a" * 64 + "\n")
    with pytest.raises(ValueError, match="expected name==version with --hash"):
        lock.read_lock("numpy==2.4.3\n")
    text = "# c\nPyYAML==6.0.3 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64 + "\n"
    assert lock.read_lock(text) == {"pyyaml": ("6.0.3", ["a" * 64, "b" * 64])}


def test_the_dockerfile_installs_exactly_the_lock():
    text = (REPO / image.DOCKERFILE).read_text()
    assert "pip install --no-cache-dir --no-deps --require-hashes --only-binary :all: -r requirements-lock.txt" in text
    assert "-r requirements-trainer.txt" not in text
    sources = [src for src, _ in image.parse_dockerfile(REPO / image.DOCKERFILE)[1]]
    assert "images/training/requirements-lock.txt" in sources


FREEZE = """PyYAML==6.0.3
segmentation_models_pytorch==0.6.0
torch==2.13.0
mlflow-skinny==3.17.2
wandb @ file:///tmp/wandb-0.31.0-py3-none-any.whl
"""


def _lock(tmp_path, entries: dict[str, str]):
    path = tmp_path / "lock.txt"
    path.write_text("".join(f"{n}=={v} \\\n    --hash=sha256:{'c' * 64}\n" for n, v in entries.items()))
    return path


def test_the_smoke_accepts_a_freeze_that_agrees_with_every_locked_package(tmp_path):
    entries = {"pyyaml": "6.0.3", "segmentation-models-pytorch": "0.6.0", "mlflow_skinny": "3.17.2"}
    assert check_lock(FREEZE, _lock(tmp_path, entries)) == 3


def test_the_smoke_names_each_locked_package_the_image_has_otherwise(tmp_path):
    entries = {"pyyaml": "6.0.3", "mlflow-skinny": "3.15.1", "wandb": "0.31.0", "onnx": "1.23.2"}
    with pytest.raises(SmokeFailure) as e:
        check_lock(FREEZE, _lock(tmp_path, entries))
    assert str(e.value).endswith(
        "mlflow-skinny: locked 3.15.1, image has 3.17.2; onnx: locked 1.23.2, image has none; "
        "wandb: locked 0.31.0, image has none"
    )
