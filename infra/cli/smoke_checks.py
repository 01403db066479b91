"""The image smoke's checks of what the build produced, made on this machine: the OCI labels against the build
arguments, and the image's ``pip freeze`` against the pip layer's lock (images/training/requirements-lock.txt)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from infra.cli import builder as oci
from infra.cli.smoke_hosts import SmokeFailure, say

REPO = Path(__file__).resolve().parents[2]
LOCK_SCRIPT = REPO / "images" / "training" / "lock.py"

# OCI label -> the build argument that sets it (images/training/Dockerfile)
LABELS = {
    "org.opencontainers.image.revision": "VCS_REF",
    "org.opencontainers.image.source": "SOURCE_URL",
    "org.opencontainers.image.base.name": "BASE_IMAGE",
    "org.opencontainers.image.base.digest": "BASE_DIGEST",
}


def check_labels(b: oci.Builder, image: str, build_args: dict) -> None:
    """Raises SmokeFailure unless the built ``image`` carries the OCI labels of ``build_args`` (a builder's layer
    cache once kept a previous commit's revision label)."""
    labels = b.image_labels(image)
    wrong = {k: labels.get(k) for k, arg in LABELS.items() if labels.get(k) != build_args[arg]}
    if wrong:
        raise SmokeFailure(f"{image}: labels {wrong} do not match the build arguments {build_args}")
    say(f"labels: revision {labels['org.opencontainers.image.revision']}, base digest {build_args['BASE_DIGEST']}")


def lock_script():
    """images/training/lock.py as a module (it lives beside the Dockerfile, outside any package)."""
    spec = importlib.util.spec_from_file_location("image_lock", LOCK_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_lock(freeze_text: str, lock_path: Path | None = None) -> int:
    """Raises SmokeFailure naming each package of the lock (default: images/training/requirements-lock.txt) that
    ``freeze_text`` (the image's ``pip freeze``) shows at another version or not at all; returns how many
    locked packages agree."""
    lock = lock_script()
    locked = lock.read_lock((lock_path or lock.LOCK).read_text())
    wrong = lock.freeze_mismatches(locked, freeze_text)
    if wrong:
        raise SmokeFailure(f"pip freeze differs from {lock_path or lock.LOCK}: " + "; ".join(wrong))
    say(f"pip freeze: the {len(locked)} locked packages at their locked versions")
    return len(locked)
