"""What push-image and ``make image-smoke`` refuse before building anything (exit 2, one line naming the input and
what was expected): a tag the registry would refuse, an architecture list the base's compiler or torch cannot
build, a CA bundle that is not a file, and too little free disk where the build and the push write.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from infra.cli.session import CliError

# The OCI distribution spec's tag grammar ("Pulling manifests": [a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}); ECR takes the
# same (ECR API reference, PutImage, imageTag: up to 300 characters, but the OCI limit applies to pushes)
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")

# TORCH_CUDA_ARCH_LIST entries the image's op can be built for: torch's list (torch/utils/cpp_extension.py,
# _get_cuda_arch_flags: supported_arches) that the base's nvcc 13.3 also compiles (`nvcc --list-gpu-code`:
# sm_75 sm_80 sm_86 sm_87 sm_88 sm_89 sm_90 sm_100 sm_110 sm_103 sm_120 sm_121; CUDA 13 dropped Maxwell, Pascal
# and Volta, so 7.0 fails after the op's first minute of compiling). Each may end in +PTX.
ARCHS = ("7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "9.0a", "10.0", "10.0a", "10.3", "10.3a", "11.0", "11.0a")
ARCHS += ("12.0", "12.0a", "12.1", "12.1a")
# torch's names for families (the same function's named_arches), for those whose members nvcc 13.3 builds
NAMED_ARCHS = {"Turing": "7.5+PTX", "Ampere+Tegra": "8.7", "Ampere": "8.0;8.6+PTX", "Ada": "8.9+PTX"}
NAMED_ARCHS |= {"Hopper": "9.0+PTX", "Blackwell+Tegra": "11.0", "Blackwell": "10.0;10.3;12.0;12.1+PTX"}


def check_tag(tag: str) -> str:
    """``tag`` when it is a valid OCI tag (:data:`TAG`); raises CliError (exit 2) otherwise."""
    if not TAG.fullmatch(tag):
        raise CliError(f"--tag {tag!r}: not an image tag; expected 1-128 of A-Z a-z 0-9 _ . - not starting with . or -")
    return tag


def check_name(name: str) -> str:
    """``name`` when it is a local image name (lower-case OCI repository path components, e.g.
    ``trainstack-training-cpu``); raises CliError (exit 2) otherwise."""
    if not re.fullmatch(r"[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*", name):
        raise CliError(f"--name {name!r}: not an image name; expected lower-case a-z 0-9 and . _ - /")
    return name


def check_archs(archs: str) -> str:
    """``archs`` when every entry (separated by ``;`` or spaces, as torch splits TORCH_CUDA_ARCH_LIST) is one of
    :data:`ARCHS`, optionally with ``+PTX``, or a family name of :data:`NAMED_ARCHS`; raises CliError (exit 2)
    naming the first entry that is not."""
    entries = [e for e in re.split(r"[;\s]+", archs.strip()) if e]
    if not entries:
        raise CliError("--archs '': expected a TORCH_CUDA_ARCH_LIST such as 8.0;8.6;9.0")
    for entry in entries:
        expanded = NAMED_ARCHS.get(entry, entry).split(";")
        if not all(e.removesuffix("+PTX") in ARCHS for e in expanded):
            raise CliError(
                f"--archs {archs!r}: {entry!r} is not an architecture the base's nvcc 13.3 and torch build; "
                f"expected entries of {' '.join(ARCHS)} (each may end in +PTX), separated by ;"
            )
    return archs


def check_ca_bundle(bundle: Optional[str]) -> Optional[str]:
    """``bundle`` resolved when it names a readable file (or None when not given); raises CliError (exit 2)
    naming it otherwise, instead of building without it."""
    if bundle is None:
        return None
    path = Path(bundle)
    if not path.is_file() or not os.access(path, os.R_OK):
        raise CliError(f"--ca-bundle {bundle}: no such readable file; expected a PEM file of CA certificates")
    return str(path.resolve())


def big_files_tmpdir() -> str:
    """Where buildah and podman write an image's compressed layers while pushing it: ``$TMPDIR``, else
    /var/tmp (containers.conf(5), ``image_copy_tmp_dir``)."""
    return os.environ.get("TMPDIR") or "/var/tmp"


def check_free_space(needs: dict[str, float]) -> None:
    """Refuses (CliError, exit 2) when a folder of ``needs`` (path -> GiB it will receive) is on a file system
    with less free space than the sum of the needs of all the folders on that file system; the message names
    the folders, what is free and what is needed. A folder that does not exist yet is measured at its nearest
    existing parent."""
    by_device: dict[int, tuple[list[str], float, float]] = {}
    for folder, gib in needs.items():
        probe = Path(folder)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        dev = _device(probe)
        names, need, _ = by_device.get(dev, ([], 0.0, 0.0))
        by_device[dev] = ([*names, folder], need + gib, shutil.disk_usage(probe).free / 2**30)
    for names, need, free in by_device.values():
        if free < need:
            raise CliError(
                f"{' and '.join(names)}: {free:.1f} GiB free, the build and push need about {need:.0f} GiB there",
                "free disk space (buildah rmi --prune, old runs/), point TMPDIR at a larger disk, "
                "or pass --min-free-gib 0 to try anyway",
            )


def _device(path: Path) -> int:
    return path.stat().st_dev


def smoke_tmpdir() -> str:
    """The folder the image smoke's own temporary folders go to (Python's ``tempfile``: ``$TMPDIR``, else /tmp)."""
    return tempfile.gettempdir()
