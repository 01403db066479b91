"""The image smoke's offline base (``make image-smoke`` without ``--base-image``): a stand-in for the DLC built
from ``images/standin/`` when the builder's store lacks it. First a Debian trixie rootfs written by ``mmdebstrap``
and imported as an image (its OS layer), then the stand-in's Containerfile on top; both are kept in the builder's
store and named by what they hold, so a later smoke reuses them. The stand-in is for offline builds only and is
never pushed. Separate from :mod:`infra.cli.smoke` (building the training image on a base and checking it): this
only provides a base.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Optional

from infra.cli import builder as oci
from infra.cli.session import CliError
from infra.cli.smoke_hosts import say

REPO = Path(__file__).resolve().parents[2]
STANDIN_DIR = "images/standin"
# Debian packages of the stand-in's rootfs: Python with headers and venv, and what the DLC's runtime stage installs
# with dnf besides its CUDA packages (gcc, gcc-c++, make, curl; docker/pytorch/Dockerfile.cuda), CAs
STANDIN_PACKAGES = "python3,python3-dev,python3-venv,gcc,g++,make,curl,ca-certificates"
STANDIN_OS = "localhost/trainstack-standin-os:trixie-" + hashlib.sha256(STANDIN_PACKAGES.encode()).hexdigest()[:8]
STANDIN = "localhost/trainstack-standin:pytorch-2.13.0-cu133"
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def ensure_standin(b: oci.Builder, ca_bundle: Optional[str], work: Path) -> str:
    """Builds the stand-in base unless it is in the builder's store (its OS layer too), with ``ca_bundle``
    mounted over its OS's CA file (:func:`infra.cli.builder.ca_mounts`); returns its name.
    Raises CliError when mmdebstrap is missing or a build fails."""
    if not b.exists(STANDIN_OS):
        tarball = work / "standin-rootfs.tar"
        say(f"writing the stand-in's Debian trixie rootfs ({STANDIN_PACKAGES}) with mmdebstrap")
        cmd = ["mmdebstrap", "--variant=minbase", f"--include={STANDIN_PACKAGES}", "trixie", str(tarball)]
        try:
            subprocess.run([*cmd, DEBIAN_MIRROR], check=True)
        except FileNotFoundError:
            raise CliError(
                "mmdebstrap not found", "as root: apt-get install mmdebstrap (make image-smoke does)"
            ) from None
        except subprocess.CalledProcessError as e:
            raise CliError(f"mmdebstrap failed with exit {e.returncode}") from None
        b.import_rootfs(tarball, STANDIN_OS)
        tarball.unlink()
    say(f"stand-in base {STANDIN} (images/standin/Containerfile, layers cached)")
    mounts = oci.ca_mounts(b, ca_bundle, STANDIN_OS)
    b.build(REPO / STANDIN_DIR, "Containerfile", STANDIN, {"OS_IMAGE": STANDIN_OS}, mounts)
    return STANDIN
