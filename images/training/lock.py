"""Write the training image's pip lock: every package the Dockerfile's pip layer installs on top of the base, pinned
with the SHA-256 of each file pip may download (pip's hash-checking mode), so that a cold build on any machine
installs the same files.

    python images/training/lock.py        (make image-lock; needs PyPI; writes images/training/requirements-lock.txt)

How: the base's installed set is images/standin/dlc-packages.txt (the Deep Learning Container's own lock,
images/standin/dlc_pins.py). For each Python the image is built on (3.12: the DLC; 3.13: the stand-in), a throw-away
venv of that interpreter gets a metadata-only stand-in of every base package, and pip resolves
requirements-trainer.txt plus the base upgrades of base_pins.py (the base's mlflow moved with the trainer's
mlflow-skinny pin), with the base's torch, torchvision and triton as constraints, as a dry run:
``pip --python VENV install --dry-run --report`` (pip docs, "Installation Report": each package to install
with its download URL and hash). A package the base already has at a version that satisfies the requirements is
kept, as pip keeps it in the image; what the report lists is what the layer installs, and only that is locked.
Wheels only, for manylinux_2_34_x86_64 (Amazon Linux 2023's glibc 2.34; Debian trixie takes them too). The two
resolutions must agree on every version; the lock holds each wheel's hash for both. No pre-releases: one in the
resolution is refused, naming it, unless a locked package pins exactly that version (:func:`unpinned_prereleases`).

The Dockerfile installs the lock with ``pip install --no-deps --require-hashes`` (exactly these files, nothing
resolved at build time) and runs ``pip check``; ``make image-smoke`` compares the image's ``pip freeze`` with it
(:func:`freeze_mismatches`), and tests/image/test_image_lock.py checks that it covers requirements-trainer.txt.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOCK = HERE / "requirements-lock.txt"
REQUIREMENTS = REPO / "requirements-trainer.txt"
BASE_PACKAGES = REPO / "images" / "standin" / "dlc-packages.txt"
PLATFORM = "manylinux_2_34_x86_64"
# the Pythons the layer is built on: the DLC's (Dockerfile.cuda ARG PYTHON_VERSION=3.12) and the stand-in's
PYTHONS = {"3.12": "the Deep Learning Container", "3.13": "the stand-in (Debian trixie)"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)==([^\s;#\\]+)")


def platforms() -> list[str]:
    """:data:`PLATFORM` and every older manylinux tag (pip does not expand ``manylinux_2_X`` tags itself, only
    the legacy ``manylinux2014``/``manylinux2010`` names: pip/_internal/utils/compatibility_tags.py)."""
    newest = int(PLATFORM.split("_")[2])
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(newest, 4, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def normalize(name: str) -> str:
    """A project name as PyPI compares them (PEP 503: lower case, runs of ``-_.`` as one ``-``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def base_packages(text: str) -> dict[str, str]:
    """normalized name -> version of the base's installed set (dlc-packages.txt: ``name==version`` lines)."""
    return {normalize(m.group(1)): m.group(2) for line in text.splitlines() if (m := _PIN.match(line.strip()))}


def inputs_digest(requirements_text: str, base_text: str) -> str:
    """16 hex of the SHA-256 of what the lock is resolved from (the lock's header records it; a test compares)."""
    return hashlib.sha256(f"{requirements_text}\0{base_text}".encode()).hexdigest()[:16]


def read_lock(text: str) -> dict[str, tuple[str, list[str]]]:
    """normalized name -> (version, sha256 hashes) of a lock in pip's hash-checking format (``name==version \\``
    continued by ``--hash=sha256:HEX`` lines). Raises ValueError for a requirement that is not ``==``-pinned or
    has no hash."""
    locked: dict[str, tuple[str, list[str]]] = {}
    for entry in text.replace("\\\n", " ").splitlines():
        entry = entry.split("#", 1)[0].strip() if not entry.lstrip().startswith("#") else ""
        if not entry:
            continue
        match = _PIN.match(entry)
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", entry)
        if not match or not hashes:
            raise ValueError(f"lock entry {entry[:80]!r}: expected name==version with --hash=sha256:... options")
        locked[normalize(match.group(1))] = (match.group(2), hashes)
    return locked


def freeze_mismatches(locked: dict[str, tuple[str, list[str]]], freeze_text: str) -> list[str]:
    """One line for each locked package that ``pip freeze``'s output ``freeze_text`` shows at another version,
    or not at all (``name @ URL`` lines count as not installed from the index); empty when the image agrees."""
    frozen = {normalize(m.group(1)): m.group(2) for line in freeze_text.splitlines() if (m := _PIN.match(line.strip()))}
    wrong = []
    for name, (version, _) in sorted(locked.items()):
        if frozen.get(name) != version:
            wrong.append(f"{name}: locked {version}, image has {frozen.get(name, 'none')}")
    return wrong


def _python(version: str) -> str:
    """An interpreter of ``version``: pythonX.Y on PATH, else pyenv's. Raises SystemExit naming what to install."""
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    for found in filter(None, candidates):  # a pyenv shim on PATH may not run this version
        if subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
            return found
    raise SystemExit(f"lock: no python{version} (PATH or pyenv); install it (`pyenv install {version}`)")


def _fake_base(venv: Path, base: dict[str, str]) -> None:
    """Metadata-only dist-info folders of the base's packages in ``venv``: pip sees them installed."""
    (site,) = venv.glob("lib/python*/site-packages")
    for name, version in base.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("trainstack-lock\n")


def resolve(version: str, requirement_files: list[Path], constraints: Path, base: dict[str, str]) -> dict:
    """normalized name -> (version, sha256) of what pip would install on ``base`` with Python ``version``."""
    with tempfile.TemporaryDirectory(prefix="image-lock-") as tmp:
        venv, report = Path(tmp) / "venv", Path(tmp) / "report.json"
        subprocess.run([_python(version), "-m", "venv", "--without-pip", str(venv)], check=True)
        _fake_base(venv, base)
        cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "--isolated", "install"]
        cmd += ["--dry-run", "--quiet", "--report", str(report), "--only-binary", ":all:"]
        cmd += [a for tag in platforms() for a in ("--platform", tag)]
        cmd += ["--implementation", "cp", "--python-version", version, "-c", str(constraints)]
        for path in requirement_files:
            cmd += ["-r", str(path)]
        subprocess.run(cmd, check=True)
        items = json.loads(report.read_text())["install"]
    out = {}
    for item in items:
        archive = item["download_info"].get("archive_info", {})
        sha = archive.get("hashes", {}).get("sha256") or archive.get("hash", "").removeprefix("sha256=")
        pins = item["metadata"].get("requires_dist") or []
        out[normalize(item["metadata"]["name"])] = (item["metadata"]["version"], sha, pins)
    return out


def unpinned_prereleases(resolved: dict[str, tuple[str, str, list[str]]]) -> list[str]:
    """``name==version`` of each pre-release in ``resolved`` (name -> (version, sha256, Requires-Dist lines))
    that no resolved package pins exactly (``name==version`` in its Requires-Dist): a pre-release the resolver
    chose where a dependency did not demand it. wandb 0.31.0 pins ``cwevals==0.0.1b1`` and opentelemetry-sdk
    ``opentelemetry-semantic-conventions==0.66b2`` (projects that publish no final release): those are kept."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    demanded = set()
    for _, _, requires in resolved.values():
        for line in requires:
            req = Requirement(line)
            exact = [s.version for s in req.specifier if s.operator in ("==", "===")]
            demanded |= {(normalize(req.name), v) for v in exact}
    return sorted(
        f"{name}=={version}"
        for name, (version, _, _) in resolved.items()
        if Version(version).is_prerelease and (name, version) not in demanded
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python images/training/lock.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(LOCK), help="the lock file to write (default: %(default)s)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import base_pins

    requirements_text, base_text = REQUIREMENTS.read_text(), BASE_PACKAGES.read_text()
    base = base_packages(base_text)
    keep, moves = base_pins.plan(requirements_text, lambda name: base.get(normalize(name)))
    resolved: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="image-lock-") as tmp:
        constraints, upgrades = Path(tmp) / "constraints.txt", Path(tmp) / "base-upgrades.txt"
        constraints.write_text("".join(f"{line}\n" for line in keep))
        upgrades.write_text("".join(f"{line}\n" for line in moves))
        for version in PYTHONS:
            resolved[version] = resolve(version, [REQUIREMENTS, upgrades], constraints, base)
    first, *others = resolved.values()
    for version, got in resolved.items():
        differ = {n: (first.get(n, ("-",))[0], got.get(n, ("-",))[0]) for n in first.keys() | got.keys()}
        differ = {n: v for n, v in differ.items() if v[0] != v[1]}
        if differ:
            raise SystemExit(f"lock: Python {version} resolves other versions than {list(PYTHONS)[0]}: {differ}")
    pre = unpinned_prereleases(first)
    if pre:
        raise SystemExit(f"lock: pre-releases no locked package pins: {', '.join(pre)}; pin a final release")
    held = sorted(n for n in first if n in {normalize(k.split("==")[0]) for k in keep})
    if held:
        raise SystemExit(f"lock: the resolution replaces the base's {held}")
    lines = [
        "# The training image's pip layer (images/training/Dockerfile: pip install --no-deps --require-hashes): every",
        "# package it installs on top of the base, with the hash of its wheel for each Python the image is built on.",
        "# Written by `python images/training/lock.py` (make image-lock) from requirements-trainer.txt and the base's",
        f"# set (images/standin/dlc-packages.txt); Pythons {', '.join(PYTHONS)}, {PLATFORM}. Do not edit.",
        f"# inputs: {inputs_digest(requirements_text, base_text)}",
    ]
    for name in sorted(first):
        hashes = sorted({got[name][1] for got in resolved.values()})
        lines.append(f"{name}=={first[name][0]} \\")
        lines += [f"    --hash=sha256:{h}" + (" \\" if i < len(hashes) - 1 else "") for i, h in enumerate(hashes)]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"lock: {len(first)} packages -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
