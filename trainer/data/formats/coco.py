"""COCO-format object detection annotations: scan and validate a split (:class:`CocoSplit`, :func:`scan_coco`).

Layout: an annotations JSON in the COCO detection format (https://cocodataset.org/#format-data) plus a folder of
images::

    {"images":      [{"id": int, "file_name": str, "width": int, "height": int}, ...],
     "annotations": [{"id": int, "image_id": int, "category_id": int, "bbox": [x, y, w, h],
                      "iscrowd": 0 | 1 (optional, 0), "area": float (optional, unused)}, ...],
     "categories":  [{"id": int, "name": str}, ...]}

``bbox`` is in pixels of the image as stored (``x, y`` = top-left corner, ``w, h`` = extent). Category ids may be
0-based, 1-based or sparse (COCO's 1..90 with gaps). The label space (:data:`LABEL_SPACES`, the config's
``label_space``) says what a model's class index is: ``contiguous`` (the default) numbers the K categories
``0..K-1`` in increasing id order; ``coco_ids`` keeps the category id itself as the label, with ``max id + 1``
classes (upstream DINO's ``datasets/coco.py`` and its ``num_classes = 91`` on COCO 2017, whose ids run 1..90),
so a checkpoint trained on COCO by IDEA-Research/DINO fits its class heads as they are. :class:`LabelMap` is the one
mapping both ways (label <-> category id <-> name); :func:`apply_label_space` puts a scanned split's labels in
its space (both in :mod:`trainer.data.formats.coco_labels`, part of this reader, imported here).
Images without boxes are kept (negatives). ``iscrowd=1`` boxes are not training targets: they are kept aside
(:meth:`CocoSplit.crowd`) for evaluation, which treats them as ignore regions.

Bad-input policy (:func:`scan_coco`). Every problem is named: the JSON file, the id(s) concerned and what was
expected, in one line; for per-entry problems the count and the first 3 examples.

* **Fatal** (:class:`DataError`, nothing is trained): the file is missing or is not JSON (line and column), a
  top-level key (``images``, ``annotations``, ``categories``) is missing or not a list, an entry is not an object
  or lacks a required key or has one of the wrong type (ids and sizes must be integers, ``bbox`` 4 finite
  numbers, ``iscrowd`` 0 or 1), duplicate image/annotation/category ids, an annotation whose ``image_id`` or
  ``category_id`` is not declared, no images or no categories, the image folder is missing. These are structural:
  the file was not written for this reader, and guessing would train on wrong labels.
* **Skipped and counted** (the *image* is left out, never just the box: an image missing one of its objects
  would teach the model that the object is background): a box with a non-positive width or height, a box
  outside its image by more than :data:`BOX_TOLERANCE_PX` (1 px; boxes overhanging by up to 1 px are clipped to
  the image, a common rounding artefact of exporters), and an image file missing on disk. Above
  ``max_bad_fraction`` of the split's images (or all of them) -> :class:`DataError` naming examples; below it the
  images are left out and :attr:`CocoSplit.report` lists them (one line for the log).
* **While loading**: a file that cannot be decoded (corrupt, truncated, over
  :data:`~trainer.data.formats.image_decode.MAX_IMAGE_PIXELS`) or whose decoded size differs from the JSON's
  ``width``/``height`` (its boxes would land on the wrong pixels) is a :class:`BadSample`, as in ImageFolder:
  replaced by the next good image in training, dropped in evaluation, counted by the loop under
  ``max_bad_fraction``. :func:`check_coco_files` finds them up front for the validation split.

The keyed dataset, DINO's transforms and the collate over a split live in
:mod:`trainer.data.formats.coco_dataset`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from trainer.data.formats import coco_cache
from trainer.data.formats.coco_cache import ParsedCoco
from trainer.data.formats.coco_labels import LABEL_SPACES, LabelMap, apply_label_space
from trainer.data.formats.coco_parse import BOX_TOLERANCE_PX, EXAMPLES, _examples, parse
from trainer.data.formats.columns import IntColumn, StringColumn
from trainer.data.formats.imagefolder import check_files
from trainer.errors import DataError

__all__ = [
    "BOX_TOLERANCE_PX",
    "EXAMPLES",
    "LABEL_SPACES",
    "CocoSplit",
    "DataError",
    "LabelMap",
    "apply_label_space",
    "check_coco_files",
    "scan_coco",
]


# --- the split --------------------------------------------------------------------------------------------
@dataclass
class CocoSplit:
    """One validated split: images, their boxes as flat arrays, the category map, what was left out.

    Per image ``i`` (``0 <= i < len(image_ids)``): ``image_ids[i]`` (the JSON id), ``paths[i]`` (``images / file_name``), ``sizes[i]`` = ``(height, width)`` in pixels as the JSON states them; its training boxes are
    ``boxes[box_start[i]:box_start[i + 1]]`` (float32 (N, 4), XYXY, pixels, clipped to the image) with labels
    ``labels[...]`` (int64, in the split's ``label_space``: contiguous 0..K-1 as scanned, or the category ids after
    :func:`apply_label_space`), its crowd boxes likewise ``crowd_boxes``/``crowd_labels`` over ``crowd_start``.
    ``categories[k]`` / ``label_to_category_id[k]``: the name and JSON id of the k-th declared category in id
    order (= contiguous label k); :attr:`label_map` maps labels of either space.
    ``left_out``: ``(image id, file name, why)`` of the images skipped for a bad box or a missing file;
    ``report``: log lines about them (empty when none).

    ``image_ids``, ``paths`` and ``sizes`` are read like lists (``int``, ``str``, ``(h, w)`` tuples) but are
    flat numpy buffers (:mod:`trainer.data.formats.columns`): no Python object per image, so loader workers do
    not grow over an epoch.
    """

    annotations: Path
    images_dir: Path
    name: str
    categories: list[str]
    label_to_category_id: list[int]
    image_ids: IntColumn
    paths: StringColumn
    sizes: IntColumn
    boxes: np.ndarray
    labels: np.ndarray
    box_start: np.ndarray
    crowd_boxes: np.ndarray
    crowd_labels: np.ndarray
    crowd_start: np.ndarray
    left_out: list[tuple[int, str, str]] = field(default_factory=list)
    report: list[str] = field(default_factory=list)
    label_space: str = "contiguous"

    def __len__(self) -> int:
        return len(self.image_ids)

    @property
    def category_id_to_label(self) -> dict[int, int]:
        """JSON category id -> contiguous label."""
        return {c: i for i, c in enumerate(self.label_to_category_id)}

    @property
    def label_map(self) -> LabelMap:
        """The split's :class:`LabelMap` (its declared categories in its ``label_space``)."""
        return LabelMap(self.label_space, tuple(self.label_to_category_id), tuple(self.categories))

    def targets(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Training boxes (float32 (N, 4) XYXY pixels) and labels (int64 (N,)) of image ``i``."""
        a, b = self.box_start[i], self.box_start[i + 1]
        return self.boxes[a:b], self.labels[a:b]

    def crowd(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Crowd boxes (float32 (M, 4) XYXY pixels) and their labels (int64 (M,)) of image ``i``."""
        a, b = self.crowd_start[i], self.crowd_start[i + 1]
        return self.crowd_boxes[a:b], self.crowd_labels[a:b]

    def census(self) -> str:
        """One line for the log, e.g. ``677 images, 3 categories, 3,106 boxes, 0 crowd, 0 images without boxes``
        (images without boxes: no non-crowd box; with ``; N left out`` when images were skipped)."""
        negatives = int(np.count_nonzero(np.diff(self.box_start) == 0))
        line = (
            f"{len(self.image_ids):,} images, {len(self.categories)} categories, {len(self.boxes):,} boxes, "
            f"{len(self.crowd_boxes):,} crowd, {negatives:,} images without boxes"
        )
        if self.left_out:
            line += f"; {len(self.left_out):,} images left out (bad box or missing file)"
        return line


def _read_parsed(annotations: Path, split_name: str, cache_dir: str | Path | None) -> ParsedCoco:
    """The :class:`ParsedCoco` of ``annotations``: from the cache when ``cache_dir`` holds it, else parsed (and
    stored there when ``cache_dir`` is given)."""
    folder = None
    if cache_dir is not None and annotations.is_file():
        folder = coco_cache.cache_folder(Path(cache_dir), coco_cache.sha256_file(annotations))
        hit = coco_cache.load(folder)
        if hit is not None:
            return hit
    parsed = parse(annotations, split_name)
    if folder is not None:
        coco_cache.store(parsed, folder)
    return parsed


def _missing_files(images: Path, names: StringColumn, skip: set) -> dict[int, str]:
    """Image index -> why, for each file not on disk (one directory listing, then a stat for the rest)."""
    try:
        listed = {e.name for e in os.scandir(images) if e.is_file()}
    except OSError:
        listed = set()
    out = {}
    for i in range(len(names)):
        if i in skip:
            continue
        name = names.name(i)
        if name in listed or os.path.isfile(os.path.join(images, name)):
            continue
        path = images / name
        out[i] = f"file {path} {'is not a file' if path.exists() else 'does not exist'}"
    return out


def scan_coco(
    annotations: str | Path,
    images: str | Path,
    split_name: str,
    max_bad_fraction: float = 0.01,
    *,
    cache_dir: str | Path | None = None,
) -> CocoSplit:
    """Read and validate a COCO detection split: the JSON ``annotations`` and the image folder ``images``.

    Categories are sorted by id and numbered 0..K-1. Each non-crowd box becomes a training target (XYXY pixels,
    float32); crowd boxes are kept aside; images without boxes stay. See the module docstring for the policy.
    The JSON is read once into compact tuples and checked over whole columns with numpy
    (:mod:`trainer.data.formats.coco_parse`; docs/benchmarks.md, "Scale", compares it with pycocotools' ``COCO()``
    and ``json.load``).

    Args:
        annotations: the JSON file.
        images: folder that ``file_name`` is relative to.
        split_name: named in messages (``data split 'train': ...``).
        max_bad_fraction: largest fraction of images that may be left out for a bad box or a missing file.
        cache_dir: when given, the parse is stored there keyed by the JSON's SHA-256 and later calls map it
            (:mod:`trainer.data.formats.coco_cache`); the image files are checked on every call.

    Raises:
        DataError: a structural problem (fatal), or more than ``max_bad_fraction`` of the images (or all of them)
            left out; one line naming the JSON file, ids and what was expected.
    """
    annotations, images = Path(annotations), Path(images)
    where = f"data split '{split_name}': {annotations}"
    p = _read_parsed(annotations, split_name, cache_dir)
    if not images.is_dir():
        what = "is a file, not a folder" if images.exists() else "does not exist"
        raise DataError(f"{where}: image folder {images} {what} (file_name entries are relative to it)")

    why = dict(zip(p.bad_images.tolist(), p.bad_why))
    why.update(_missing_files(images, p.file_names, set(why)))
    n_img = len(p.image_ids)
    left_out = [(int(p.image_ids[k]), p.file_names.name(k), r) for k, r in sorted(why.items())]
    report = []
    if left_out:
        n_box = sum(1 for *_, r in left_out if r.startswith("annotation"))
        names = _examples([f"image {i} ({fn}): {r}" for i, fn, r in left_out])
        counts = f"{n_box} with a bad box ({p.n_bad_boxes} box(es) in all), {len(left_out) - n_box} missing file(s)"
        if len(left_out) > max_bad_fraction * n_img or len(left_out) == n_img:
            raise DataError(
                f"{where}: {len(left_out)} of {n_img} images cannot be used ({counts}), more than "
                f"max_bad_fraction={max_bad_fraction}; fix or remove them: {names}"
            )
        report.append(
            f"data: {split_name}: {len(left_out)} of {n_img} image(s) left out ({counts}; boxes may overhang by "
            f"{BOX_TOLERANCE_PX:g} px): {names}"
        )
    files = p.file_names
    split = CocoSplit(
        annotations=annotations,
        images_dir=images,
        name=split_name,
        categories=list(p.cat_names),
        label_to_category_id=p.cat_ids.tolist(),
        image_ids=IntColumn(p.image_ids),
        paths=StringColumn(files.data, files.offsets, str(images)),
        sizes=IntColumn(p.sizes),
        boxes=p.boxes,
        labels=p.labels,
        box_start=p.box_start,
        crowd_boxes=p.crowd_boxes,
        crowd_labels=p.crowd_labels,
        crowd_start=p.crowd_start,
        left_out=left_out,
        report=report,
    )
    return _subset(split, [k for k in range(n_img) if k not in why]) if why else split


def _subset(split: CocoSplit, keep: list[int]) -> CocoSplit:
    """``split`` restricted to the images at positions ``keep`` (in order)."""

    rows = np.asarray(keep, dtype=np.int64)

    def gather(arr, st):
        st = np.asarray(st)
        lens = st[rows + 1] - st[rows]
        start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=start[1:])
        idx = np.repeat(st[rows] - start[:-1], lens) + np.arange(int(start[-1]), dtype=np.int64)
        return np.asarray(arr)[idx], start

    boxes, start = gather(split.boxes, split.box_start)
    labels, _ = gather(split.labels, split.box_start)
    crowd, cstart = gather(split.crowd_boxes, split.crowd_start)
    clabels, _ = gather(split.crowd_labels, split.crowd_start)
    return replace(
        split,
        image_ids=split.image_ids.take(keep),
        paths=split.paths.take(keep),
        sizes=split.sizes.take(keep),
        boxes=boxes.reshape(-1, 4),
        labels=labels,
        box_start=start,
        crowd_boxes=crowd.reshape(-1, 4),
        crowd_labels=clabels,
        crowd_start=cstart,
    )


def check_coco_files(
    split: CocoSplit, max_bad_fraction: float, full: bool | None = None
) -> tuple[CocoSplit, list[str]]:
    """Decode (or read the header of) every image of ``split`` up front and leave the unreadable ones out, as
    :func:`trainer.data.formats.imagefolder.check_split` does for ImageFolder (meant for the validation split).

    Returns ``(split without the bad images, report lines)``.

    Raises:
        DataError: more than ``max_bad_fraction`` of the images (or all of them) cannot be read; names them.
    """
    bad, how = check_files(split.paths, full)
    if not bad:
        return split, []
    n = len(split.paths)
    names = _examples([f"{b.path} ({b.error})" for b in bad])
    if len(bad) > max_bad_fraction * n or len(bad) == n:
        raise DataError(
            f"data split '{split.name}': {len(bad)} of {n} image files cannot be read, more than "
            f"max_bad_fraction={max_bad_fraction}; remove or fix them: {names}"
        )
    dropped = {b.path for b in bad}
    kept = _subset(split, [i for i, p in enumerate(split.paths) if p not in dropped])
    return kept, [f"data: {split.name}: {len(bad)} of {n} file(s) cannot be read ({how}); left out: {names}"]
