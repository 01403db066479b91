"""COCO-format object detection annotations: scan and validate a split (:class:`CocoSplit`, :func:`scan_coco`).

Layout: an annotations JSON in the COCO detection format (https://cocodataset.org/#format-data) plus a folder of
images::

    {"images":      [{"id": int, "file_name": str, "width": int, "height": int}, ...],
     "annotations": [{"id": int, "image_id": int, "category_id": int, "bbox": [x, y, w, h],
                      "iscrowd": 0 | 1 (optional, 0), "area": float (optional, unused)}, ...],
     "categories":  [{"id": int, "name": str}, ...]}

``bbox`` is in pixels of the image as stored (``x, y`` = top-left corner, ``w, h`` = extent). Category ids may be
0-based, 1-based or sparse (COCO's 1..90 with gaps): they map to contiguous labels ``0..K-1`` in increasing id
order; :attr:`CocoSplit.label_to_category_id` maps back (for writing detections in COCO form for evaluation).
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

import collections
import itertools
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import orjson

from trainer.data.formats import coco_cache
from trainer.data.formats.coco_cache import ParsedCoco
from trainer.data.formats.columns import IntColumn, StringColumn
from trainer.data.formats.imagefolder import check_files
from trainer.errors import DataError

#: A box may overhang its image by this many pixels on any side (it is clipped); more makes the image bad.
BOX_TOLERANCE_PX = 1.0

#: How many examples a one-line error or report names.
EXAMPLES = 3

_REQUIRED = {
    "images": {
        "id": "an integer",
        "file_name": "a string",
        "width": "a positive integer",
        "height": "a positive integer",
    },
    "annotations": {"id": "an integer", "image_id": "an integer", "category_id": "an integer", "bbox": "[x, y, w, h]"},
    "categories": {"id": "an integer", "name": "a string"},
}


# --- the split --------------------------------------------------------------------------------------------
@dataclass
class CocoSplit:
    """One validated split: images, their boxes as flat arrays, the category map, what was left out.

    Per image ``i`` (``0 <= i < len(image_ids)``): ``image_ids[i]`` (the JSON id), ``paths[i]`` (``images / file_name``), ``sizes[i]`` = ``(height, width)`` in pixels as the JSON states them; its training boxes are
    ``boxes[box_start[i]:box_start[i + 1]]`` (float32 (N, 4), XYXY, pixels, clipped to the image) with labels
    ``labels[...]`` (int64, contiguous 0..K-1), its crowd boxes likewise ``crowd_boxes``/``crowd_labels`` over
    ``crowd_start``. ``categories[label]`` is the category name, ``label_to_category_id[label]`` its JSON id.
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

    def __len__(self) -> int:
        return len(self.image_ids)

    @property
    def category_id_to_label(self) -> dict[int, int]:
        """JSON category id -> contiguous label."""
        return {c: i for i, c in enumerate(self.label_to_category_id)}

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


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _key_problem(section: str, key: str, value) -> bool:
    """True when ``value`` is not what ``section``'s ``key`` must be."""
    if key in ("id", "image_id", "category_id"):
        return not _is_int(value)
    if key in ("width", "height"):
        return not (_is_int(value) and value > 0)
    if key in ("file_name", "name"):
        return not (isinstance(value, str) and value)
    if key == "bbox":
        return not (isinstance(value, (list, tuple)) and len(value) == 4 and all(_is_num(v) for v in value))
    if key == "iscrowd":
        return value not in (0, 1) or isinstance(value, float) and not value.is_integer()
    return False


def _examples(items: list[str], n: int = EXAMPLES) -> str:
    return "; ".join(items[:n]) + (f"; (+{len(items) - n} more)" if len(items) > n else "")


def _load_json(path: Path, where: str) -> dict:
    if not path.is_file():
        what = "is a folder" if path.exists() else "does not exist"
        raise DataError(f"{where}: annotations file {path} {what} (expected a COCO detection JSON)")
    try:
        return orjson.loads(path.read_bytes())  # 2-3x json's speed, the same objects
    except orjson.JSONDecodeError:
        pass  # not strict JSON for orjson (e.g. NaN, ints past 64 bits, bad UTF-8): json decides, and words it
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: {path} is not UTF-8 text (byte {e.start}); expected a COCO JSON") from None


def _check_entries(data: dict, where: str) -> None:
    """Raise on a missing/non-list top-level key, a non-object entry or a missing/malformed required key."""
    for section in _REQUIRED:
        if section not in data:
            raise DataError(
                f"{where}: missing top-level key '{section}' (a COCO detection file has 'images', 'annotations' "
                f"and 'categories'; present: {', '.join(map(repr, sorted(data))) or 'none'})"
            )
        if not isinstance(data[section], list):
            raise DataError(f"{where}: '{section}' is a {type(data[section]).__name__}, expected a list of objects")
    for section, required in _REQUIRED.items():
        bad = []
        for k, e in enumerate(data[section]):
            if not isinstance(e, dict):
                bad.append(f"entry #{k} is not an object (got {type(e).__name__} {e!r:.40})")
                continue
            name = f"entry #{k} (id {e['id']!r})" if "id" in e else f"entry #{k}"
            missing = [key for key in required if key not in e]
            if missing:
                bad.append(f"{name} has no {', '.join(map(repr, missing))}")
                continue
            wrong = [key for key in (*required, "iscrowd") if key in e and _key_problem(section, key, e[key])]
            if wrong:
                bad.append(
                    f"{name} has {', '.join(f'{key}={e[key]!r}' for key in wrong)}, expected "
                    + ", ".join(f"{key} = {required.get(key, '0 or 1')}" for key in wrong)
                )
        if bad:
            expected = ", ".join(f"{key} ({what})" for key, what in required.items())
            raise DataError(
                f"{where}: {len(bad)} '{section}' entr{'y is' if len(bad) == 1 else 'ies are'} malformed "
                f"(each needs {expected}): {_examples(bad)}"
            )


def _check_unique(data: dict, where: str) -> None:
    for section in ("images", "annotations", "categories"):
        counts = collections.Counter(e["id"] for e in data[section])
        dupes = [f"{i} ({n} entries)" for i, n in counts.items() if n > 1]
        if dupes:
            raise DataError(
                f"{where}: {len(dupes)} duplicate id(s) in '{section}': {_examples(dupes)}; each id must appear once"
            )


def _int64(values: list, where: str) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise DataError(f"{where}: an id does not fit in a signed 64-bit integer (expected ids below 2**63)") from None


def _only(values: list, types: set) -> bool:
    """Every value's exact type is in ``types`` (bool is not int here)."""
    return set(map(type, values)) <= types


def _columns(data: dict) -> dict | None:
    """The sections as lists of values, when every entry is a well-formed object; None when anything is off
    (:func:`_check_entries` then names it). Type checks run over whole columns (C loops), not per entry."""
    ims, anns, cats = data["images"], data["annotations"], data["categories"]
    try:
        c = {
            "img_id": [e["id"] for e in ims],
            "file_name": [e["file_name"] for e in ims],
            "width": [e["width"] for e in ims],
            "height": [e["height"] for e in ims],
            "ann_id": [e["id"] for e in anns],
            "image_id": [e["image_id"] for e in anns],
            "category_id": [e["category_id"] for e in anns],
            "bbox": [e["bbox"] for e in anns],
            "iscrowd": [e.get("iscrowd", 0) for e in anns],
            "cat_id": [e["id"] for e in cats],
            "name": [e["name"] for e in cats],
        }
        ok = (
            all(
                _only(c[k], {int}) for k in ("img_id", "width", "height", "ann_id", "image_id", "category_id", "cat_id")
            )
            and all(_only(c[k], {str}) and all(c[k]) for k in ("file_name", "name"))
            and min(c["width"], default=1) > 0
            and min(c["height"], default=1) > 0
            and _only(c["bbox"], {list})
            and set(map(len, c["bbox"])) <= {4}
            and set(c["iscrowd"]) <= {0, 1}
        )
        if not ok:
            return None
        flat = list(itertools.chain.from_iterable(c["bbox"]))
        if not _only(flat, {int, float}):
            return None
        xywh = np.asarray(flat, dtype=np.float64).reshape(-1, 4)
        del flat
        if not np.isfinite(xywh).all():
            return None
    except (KeyError, TypeError, AttributeError, OverflowError):
        return None
    c["xywh"] = xywh
    return c


def _parse(data, where: str) -> ParsedCoco:
    """Validate the JSON's structure (the module docstring's fatal list) and turn it into flat arrays, grouping
    boxes by image and finding the bad ones; numpy over whole columns (COCO's 860k boxes: well under a second).

    Raises:
        DataError: a structural problem, in the same words as the per-entry checks.
    """
    if not isinstance(data, dict):
        raise DataError(
            f"{where}: the top level is a {type(data).__name__}, expected an object with 'images', "
            "'annotations' and 'categories'"
        )
    c = _columns(data) if all(isinstance(data.get(s), list) for s in _REQUIRED) else None
    if c is None:
        _check_entries(data, where)  # names the problem; passes only for numbers past 64 bits
        c = _columns(data)
        if c is None:
            raise DataError(f"{where}: a number does not fit in 64 bits (expected ids below 2**63, finite boxes)")
    img_id, ann_id, cat_id = _int64(c["img_id"], where), _int64(c["ann_id"], where), _int64(c["cat_id"], where)
    if any(len(np.unique(a)) != len(a) for a in (img_id, ann_id, cat_id)):
        _check_unique(data, where)
    if not len(img_id):
        raise DataError(f"{where}: 'images' is empty (expected at least one image)")
    if not len(cat_id):
        raise DataError(f"{where}: 'categories' is empty (expected at least one {{id, name}})")

    anns = data["annotations"]
    cat_order = np.argsort(cat_id, kind="stable")
    cats_sorted = cat_id[cat_order]
    a_img, a_cat = _int64(c["image_id"], where), _int64(c["category_id"], where)
    img_order = np.argsort(img_id, kind="stable")
    pos = np.minimum(np.searchsorted(img_id[img_order], a_img), len(img_id) - 1)
    known_img = img_id[img_order][pos] == a_img
    k = img_order[pos]  # image index of each annotation
    label = np.minimum(np.searchsorted(cats_sorted, a_cat), len(cats_sorted) - 1)
    known_cat = cats_sorted[label] == a_cat
    if not known_img.all():
        unknown = [f"annotation {anns[j]['id']} -> image_id {anns[j]['image_id']}" for j in np.flatnonzero(~known_img)]
        raise DataError(
            f"{where}: {len(unknown)} annotation(s) refer to an image_id not in 'images': {_examples(unknown)}"
        )
    if not known_cat.all():
        unknown = [
            f"annotation {anns[j]['id']} -> category_id {anns[j]['category_id']}" for j in np.flatnonzero(~known_cat)
        ]
        raise DataError(
            f"{where}: {len(unknown)} annotation(s) refer to a category_id not in 'categories' (ids "
            f"{', '.join(str(int(i)) for i in cats_sorted[:10])}{', ...' if len(cats_sorted) > 10 else ''}): "
            f"{_examples(unknown)}"
        )

    # boxes: the checks of the module docstring, on whole columns (float64, as Python floats)
    W = np.asarray(c["width"], dtype=np.float64)[k]
    H = np.asarray(c["height"], dtype=np.float64)[k]
    x, y, w, h = c["xywh"].T
    x1, y1, t = x + w, y + h, BOX_TOLERANCE_PX
    cx0, cx1, cy0, cy1 = np.clip(x, 0.0, W), np.clip(x1, 0.0, W), np.clip(y, 0.0, H), np.clip(y1, 0.0, H)
    nonpos = (w <= 0) | (h <= 0)
    outside = ~nonpos & ((x < -t) | (y < -t) | (x1 > W + t) | (y1 > H + t))
    no_area = ~nonpos & ~outside & ((cx1 <= cx0) | (cy1 <= cy0))
    bad = nonpos | outside | no_area
    bad_j = np.flatnonzero(bad)
    bad_images, first = np.unique(k[bad_j], return_index=True)  # first bad box of each image, in file order
    why = []
    for j in bad_j[first]:
        a, im = anns[j], data["images"][k[j]]
        size = f"{im['width']}x{im['height']}"
        if nonpos[j]:
            why.append(f"annotation {a['id']} bbox {a['bbox']} has a non-positive width or height")
        elif outside[j]:
            why.append(f"annotation {a['id']} bbox {a['bbox']} lies outside the {size} image by more than {t:g} px")
        else:
            why.append(f"annotation {a['id']} bbox {a['bbox']} has no area inside the {size} image")

    xyxy = np.stack([cx0, cy0, cx1, cy1], axis=1).astype(np.float32)
    crowd = np.asarray(c["iscrowd"], dtype=np.float64) != 0
    n = len(img_id)

    def grouped(sel):
        order = np.flatnonzero(sel)[np.argsort(k[sel], kind="stable")]
        start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(k[sel], minlength=n), out=start[1:])
        return xyxy[order], label[order].astype(np.int64), start

    boxes, labels, box_start = grouped(~bad & ~crowd)
    crowd_boxes, crowd_labels, crowd_start = grouped(~bad & crowd)
    names = c["name"]
    return ParsedCoco(
        cat_ids=cats_sorted,
        cat_names=StringColumn.from_strings(names[i] for i in cat_order),
        image_ids=img_id,
        sizes=np.stack([np.asarray(c["height"], dtype=np.int64), np.asarray(c["width"], dtype=np.int64)], axis=1),
        file_names=StringColumn.from_strings(c["file_name"]),
        boxes=boxes,
        labels=labels,
        box_start=box_start,
        crowd_boxes=crowd_boxes,
        crowd_labels=crowd_labels,
        crowd_start=crowd_start,
        bad_images=bad_images.astype(np.int64),
        bad_why=StringColumn.from_strings(why),
        n_bad_boxes=int(bad.sum()),
    )


def _read_parsed(annotations: Path, split_name: str, cache_dir: str | Path | None) -> ParsedCoco:
    """The :class:`ParsedCoco` of ``annotations``: from the cache when ``cache_dir`` holds it, else parsed (and
    stored there when ``cache_dir`` is given)."""
    where = f"data split '{split_name}': {annotations}"
    folder = None
    if cache_dir is not None and annotations.is_file():
        folder = coco_cache.cache_folder(Path(cache_dir), coco_cache.sha256_file(annotations))
        hit = coco_cache.load(folder)
        if hit is not None:
            return hit
    parsed = _parse(_load_json(annotations, f"data split '{split_name}'"), where)
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
    The JSON is read with orjson and checked over whole columns with numpy (on the 118k-image COCO train file
    faster than pycocotools' ``COCO()`` and within the memory of ``json.load``; docs/benchmarks.md, "Scale").

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
