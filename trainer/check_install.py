"""``python -m trainer.check_install``: prove that a file tree can run the trainer on its own.

Imports every module of the ``trainer`` package (``pkgutil.walk_packages``) from the tree it is run in, then
checks the architecture's import rules held while doing so: no ``infra`` and no ``aws_cdk`` module was
imported. The training image runs it at build time (images/training/Dockerfile) and the tests run it in a
copy of the image's file layout, so a module that needs a file the image does not ship fails the build
instead of the first job.

A module that fails only because an optional extra is not installed (:data:`OPTIONAL_EXTRAS`: ``ffcv``, which
the image does not ship) is listed as skipped, not failed: the trainer names the extra when a run asks for
it. Exit status: 0 when every other module imported; 1 otherwise, with one line per failing module on stderr.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Sequence
from typing import Optional

#: Top-level packages the trainer must never import (the image does not ship them).
FORBIDDEN = ("infra", "aws_cdk")
#: Optional extras: top-level module -> how to install it.
OPTIONAL_EXTRAS = {"ffcv": "make ffcv (requirements-ffcv.txt)"}


def import_all(package: str = "trainer") -> tuple[list[str], list[str], list[str]]:
    """Import ``package`` and every module below it.

    Returns (imported module names, ``"<module>: <ExceptionType>: <message>"`` for each failure,
    ``"<module> (needs <extra>)"`` for each module skipped for a missing optional extra).
    """
    pkg = importlib.import_module(package)
    done, failed, skipped = [package], [], []
    for info in pkgutil.walk_packages(pkg.__path__, prefix=package + "."):
        if info.name.endswith("__main__"):
            continue  # running it would start the command line
        try:
            importlib.import_module(info.name)
            done.append(info.name)
        except ModuleNotFoundError as e:
            extra = (e.name or "").split(".")[0]
            if extra in OPTIONAL_EXTRAS:
                skipped.append(f"{info.name} (needs {extra}: {OPTIONAL_EXTRAS[extra]})")
            else:
                failed.append(f"{info.name}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - every failure is reported, none hides another
            failed.append(f"{info.name}: {type(e).__name__}: {e}")
    return done, failed, skipped


def forbidden_imports() -> list[str]:
    """Names in ``sys.modules`` that belong to a :data:`FORBIDDEN` top-level package."""
    return sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Import everything, check the rules, print a summary; returns the exit status."""
    done, failed, skipped = import_all()
    bad = forbidden_imports()
    for line in failed:
        print(f"check_install: cannot import {line}", file=sys.stderr)
    if bad:
        print(
            f"check_install: trainer imported {', '.join(bad)} (trainer must not import {' or '.join(FORBIDDEN)})",
            file=sys.stderr,
        )
    if failed or bad:
        return 1
    import catalog

    print(
        f"check_install: {len(done)} trainer modules import from {sys.modules['trainer'].__path__[0]}; "
        f"catalog from {catalog.__file__}; no {'/'.join(FORBIDDEN)}"
        + (f"; skipped {', '.join(skipped)}" if skipped else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
