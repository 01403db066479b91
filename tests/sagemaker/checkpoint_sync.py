"""A stand-in for SageMaker's checkpoint sync between ``/opt/ml/checkpoints`` and the job's ``CheckpointConfig``
S3 prefix, as hostile as AWS documents it may be ("Use checkpoints in Amazon SageMaker AI",
https://docs.aws.amazon.com/sagemaker/latest/dg/model-checkpoints.html):

- at the start of a job, what the prefix holds is copied into the local folder (a copy: later uploads of the
  prefix are not seen; "Checkpoints added to the S3 folder after the job has started are not copied");
- while the job runs, new files are uploaded *in the background*: nothing says when a file reaches S3, so at an
  interruption the newest files may not have; S3 objects are whole or absent (a PUT is atomic), and S3 has no
  folders or renames;
- "If a checkpoint is deleted in the SageMaker container, it will also be deleted in the S3 folder": a deletion
  is small and goes through while a large upload is still in flight.

The tests' earlier stand-in, a symbolic link from ``/opt/ml/checkpoints`` to the prefix, was kinder on every
point: instantaneous, renames included, never behind.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def prefix_at_the_end(local: Path, prefix: Path, in_flight: frozenset[str] = frozenset()) -> None:
    """Set ``prefix`` to what S3 holds when the job's container is gone: every file now under ``local`` except the
    paths in ``in_flight`` (relative to ``local``: uploads a spot reclaim cut off; none when the job ended on its
    own), and none of the files ``local`` has deleted (deletions propagated). Raises ValueError when ``in_flight``
    names a file that is not there."""
    files = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    if not in_flight <= files:
        raise ValueError(f"in_flight: {sorted(in_flight - files)} not under {local}")
    shutil.rmtree(prefix, ignore_errors=True)
    for rel in sorted(files - in_flight):
        dest = prefix / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(local / rel, dest)


def restore(prefix: Path, local: Path) -> None:
    """The next job's start: ``local`` (an empty or missing folder) gets a copy of what ``prefix`` holds."""
    local.mkdir(parents=True, exist_ok=True)
    if any(local.iterdir()):
        raise ValueError(f"{local}: SageMaker restores into an empty checkpoint folder")
    if prefix.is_dir():
        shutil.copytree(prefix, local, dirs_exist_ok=True)
