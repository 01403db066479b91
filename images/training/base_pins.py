"""What the image's pip step may not change, and what it must move together, from the base image's installed set.

    python3 images/training/base_pins.py requirements-trainer.txt   (in the Dockerfile, from /opt/trainstack)

Writes ``constraints.txt``: ``torch``, ``torchvision`` and (where the base has it) ``triton`` at the base's installed
versions, so pip can never replace the base's torch. Writes ``base-upgrades.txt``: for each package of the base that
pins its other halves exactly and whose half requirements-trainer.txt pins at another version, the package itself
at that version, so that pip moves the three together instead of leaving a broken set (``pip check`` fails the
build otherwise). Today that is MLflow: the DLC ships ``mlflow`` 3.15.1 (which requires ``mlflow-skinny==3.15.1``
and ``mlflow-tracing==3.15.1``), the trainer pins ``mlflow-skinny``; the full ``mlflow`` follows the pin.
Prints both files. Standard library only (it runs with the base's Python before anything is installed).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys

KEEP = ("torch", "torchvision", "triton")
# a package of the base -> the half of it that requirements-trainer.txt may pin (the package pins it with ==)
MOVES_WITH = {"mlflow": "mlflow-skinny"}


def installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def plan(requirements_text: str, version_of=None) -> tuple[list[str], list[str]]:
    """(constraints, base upgrades) as ``name==version`` lines for a base whose installed version of a package is
    ``version_of(name)`` (None when not installed; default: this interpreter's, :func:`installed`).
    images/training/lock.py calls it with the base's package list instead."""
    version_of = version_of or installed
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#;]+)", requirements_text, re.M))
    keep = [f"{n}=={v}" for n in KEEP if (v := version_of(n))]
    moves = [f"{pkg}=={pins[half]}" for pkg, half in MOVES_WITH.items() if version_of(pkg) and half in pins]
    return keep, moves


def main(requirements: str) -> int:
    keep, moves = plan(open(requirements).read())
    for path, lines in (("constraints.txt", keep), ("base-upgrades.txt", moves)):
        with open(path, "w") as f:
            f.write("".join(f"{line}\n" for line in lines))
        print(f"{path}: {' '.join(lines) or '(empty)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
