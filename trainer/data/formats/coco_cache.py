"""A parsed COCO annotations file as a folder of ``.npy`` arrays, keyed by the JSON file's SHA-256, made once
per node and memory-mapped by every rank.

Parsing a COCO-size JSON (118k images, 860k boxes, ~160 MB) costs seconds and hundreds of MiB of Python objects;
with one process per GPU every rank would pay both. :func:`trainer.data.formats.coco.scan_coco` with a
``cache_dir`` parses once and writes what the JSON alone determines (:class:`ParsedCoco`: ids, sizes, file
names, every good box already clipped and grouped by image, the first bad box of each image) to
``<cache_dir>/coco-<sha256>-v<FORMAT>/``; later calls on the same bytes (the other local ranks, the next run)
map those arrays read-only (``np.load(mmap_mode="r")``: the page cache is shared, nothing is re-parsed). What
depends on the disk (image files present, ``max_bad_fraction``) is checked on every call.

The folder is written under a temporary name and renamed into place (atomic on POSIX), so a reader never sees
half a cache and two writers (two nodes on a shared run folder) both succeed. Any ``OSError`` while writing (a
read-only mount, a full disk) leaves the parse result in use without a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

import numpy as np

from trainer.data.formats.columns import StringColumn

#: Bump when :class:`ParsedCoco` or the parse rules change: old caches are then ignored (never misread).
FORMAT = 1

#: Environment variable naming the annotation-cache folder (else beside the run, see :func:`default_cache_dir`).
CACHE_DIR_ENV = "TRAINSTACK_CACHE_DIR"

T = TypeVar("T")


@dataclass
class ParsedCoco:
    """What a COCO detection JSON alone determines, as flat arrays (``N`` images, ``K`` categories).

    ``cat_ids`` int64 (K,) sorted, ``cat_names`` (K,) their names (label = position); ``image_ids`` int64 (N,)
    in file order, ``sizes`` int64 (N, 2) (height, width) in pixels, ``file_names`` (N,); training boxes of image
    ``i``: ``boxes[box_start[i]:box_start[i + 1]]`` float32 XYXY pixels clipped to the image, ``labels`` int64,
    crowd boxes likewise over ``crowd_start``, in annotation order; ``bad_images`` int64 (M,) the images with a
    bad box and ``bad_why`` (M,) the first problem of each (one line each); ``n_bad_boxes`` their bad boxes.
    Boxes of bad images are kept here and dropped with their image by the caller.
    """

    cat_ids: np.ndarray
    cat_names: StringColumn
    image_ids: np.ndarray
    sizes: np.ndarray
    file_names: StringColumn
    boxes: np.ndarray
    labels: np.ndarray
    box_start: np.ndarray
    crowd_boxes: np.ndarray
    crowd_labels: np.ndarray
    crowd_start: np.ndarray
    bad_images: np.ndarray
    bad_why: StringColumn
    n_bad_boxes: int


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of the file's bytes (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cache_folder(cache_dir: Path, digest: str) -> Path:
    """The cache folder for a JSON whose SHA-256 is ``digest``."""
    return Path(cache_dir) / f"coco-{digest}-v{FORMAT}"


def load(folder: Path) -> ParsedCoco | None:
    """The :class:`ParsedCoco` in ``folder`` memory-mapped read-only, or None when there is none (or it cannot
    be read: a cache is never worth a failure)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            return None
        arrays = {}
        for f in fields(ParsedCoco):
            if f.name == "n_bad_boxes":
                continue
            if f.name in ("cat_names", "file_names", "bad_why"):
                arrays[f.name] = StringColumn(
                    np.load(folder / f"{f.name}.data.npy", mmap_mode="r"),
                    np.load(folder / f"{f.name}.offsets.npy", mmap_mode="r"),
                )
            else:
                arrays[f.name] = np.load(folder / f"{f.name}.npy", mmap_mode="r")
        return ParsedCoco(**arrays, n_bad_boxes=int(meta["n_bad_boxes"]))
    except (OSError, ValueError, KeyError):
        return None


def store(parsed: ParsedCoco, folder: Path) -> bool:
    """Write ``parsed`` to ``folder`` atomically (a temporary sibling renamed into place). Returns False when it
    could not be written (read-only or full file system); True when it is there (ours or another writer's).

    A ``folder`` that is there but cannot be read (:func:`load` gives None: a truncated or deleted array, a
    damaged meta.json) is moved aside and removed first, so the fresh parse replaces it instead of every later
    run parsing again. Readers that mapped its files keep them (Linux keeps unlinked files open).
    """
    folder = Path(folder)
    if folder.is_dir():
        if load(folder) is not None:
            return True
        damaged = folder.with_name(f".{folder.name}.damaged-{os.getpid()}")
        try:
            os.rename(folder, damaged)
        except OSError:
            return folder.is_dir()  # another process moved or replaced it first, or the folder is read-only
        shutil.rmtree(damaged, ignore_errors=True)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError:
        return False
    try:
        for f in fields(ParsedCoco):
            value = getattr(parsed, f.name)
            if isinstance(value, StringColumn):
                np.save(tmp / f"{f.name}.data.npy", np.asarray(value.data))
                np.save(tmp / f"{f.name}.offsets.npy", np.asarray(value.offsets))
            elif isinstance(value, np.ndarray):
                np.save(tmp / f"{f.name}.npy", np.ascontiguousarray(value))
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "n_bad_boxes": int(parsed.n_bad_boxes)}))
        os.rename(tmp, folder)
        return True
    except OSError:
        return folder.is_dir()  # another writer won the rename (ENOTEMPTY/EEXIST), or the disk failed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_cache_dir(checkpoint_dir: str | Path | None) -> Path:
    """Where the annotation cache goes: ``$TRAINSTACK_CACHE_DIR`` when set, else ``<checkpoint_dir>/../
    annotation-cache`` (beside the run, like the video feature cache), else ``<tmp>/trainstack-annotation-cache``
    when there is no checkpoint folder. The data folder is never written (it is often a read-only mount: FSx,
    S3 via Mountpoint, SageMaker's input channels)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    if checkpoint_dir:
        return Path(checkpoint_dir).resolve().parent / "annotation-cache"
    return Path(tempfile.gettempdir()) / "trainstack-annotation-cache"


def writable_cache_dir(preferred: Path) -> Path | None:
    """``preferred`` when it can be created and written, else ``<tmp>/trainstack-annotation-cache`` when that
    can, else None (no cache: every rank parses)."""
    for d in (Path(preferred), Path(tempfile.gettempdir()) / "trainstack-annotation-cache"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK | os.X_OK):
                return d
        except OSError:
            continue
    return None


def once_per_node(make: Callable[[], T], local_rank: int, barrier: Callable[[], None] | None) -> T:
    """``make()`` on local rank 0 first (it parses and fills the cache), then, after ``barrier()``, on every
    other local rank (which map what rank 0 stored). Without ``barrier`` (one process) just ``make()``.

    Every rank reaches the barrier even when rank 0's ``make`` raises (then the others, parsing the same file,
    raise the same error), so a bad file never leaves ranks waiting for the collective timeout.
    """
    if barrier is None:
        return make()
    failure = None
    if local_rank == 0:
        try:
            out = make()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the barrier the other ranks wait on
            failure = e
    barrier()
    if failure is not None:
        raise failure
    return make() if local_rank != 0 else out
