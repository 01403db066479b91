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

import collections
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from trainer.data.formats.coco_labels import LABEL_SPACES, LabelMap, apply_label_space
from trainer.data.formats.imagefolder import check_files
from trainer.errors import DataError

__all__ = ["LABEL_SPACES", "CocoSplit", "LabelMap", "apply_label_space", "check_coco_files", "scan_coco"]

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
    ``labels[...]`` (int64, in the split's ``label_space``: contiguous 0..K-1 as scanned, or the category ids after
    :func:`apply_label_space`), its crowd boxes likewise ``crowd_boxes``/``crowd_labels`` over ``crowd_start``.
    ``categories[k]`` / ``label_to_category_id[k]``: the name and JSON id of the k-th declared category in id
    order (= contiguous label k); :attr:`label_map` maps labels of either space.
    ``left_out``: ``(image id, file name, why)`` of the images skipped for a bad box or a missing file;
    ``report``: log lines about them (empty when none).
    """

    annotations: Path
    images_dir: Path
    name: str
    categories: list[str]
    label_to_category_id: list[int]
    image_ids: list[int]
    paths: list[str]
    sizes: list[tuple[int, int]]
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


def scan_coco(
    annotations: str | Path, images: str | Path, split_name: str, max_bad_fraction: float = 0.01
) -> CocoSplit:
    """Read and validate a COCO detection split: the JSON ``annotations`` and the image folder ``images``.

    Categories are sorted by id and numbered 0..K-1. Each non-crowd box becomes a training target (XYXY pixels,
    float32); crowd boxes are kept aside; images without boxes stay. See the module docstring for the policy.

    Args:
        annotations: the JSON file.
        images: folder that ``file_name`` is relative to.
        split_name: named in messages (``data split 'train': ...``).
        max_bad_fraction: largest fraction of images that may be left out for a bad box or a missing file.

    Raises:
        DataError: a structural problem (fatal), or more than ``max_bad_fraction`` of the images (or all of them)
            left out; one line naming the JSON file, ids and what was expected.
    """
    annotations, images = Path(annotations), Path(images)
    where = f"data split '{split_name}': {annotations}"
    data = _load_json(annotations, f"data split '{split_name}'")
    if not isinstance(data, dict):
        raise DataError(
            f"{where}: the top level is a {type(data).__name__}, expected an object with 'images', "
            "'annotations' and 'categories'"
        )
    _check_entries(data, where)
    _check_unique(data, where)
    if not data["images"]:
        raise DataError(f"{where}: 'images' is empty (expected at least one image)")
    if not data["categories"]:
        raise DataError(f"{where}: 'categories' is empty (expected at least one {{id, name}})")
    if not images.is_dir():
        what = "is a file, not a folder" if images.exists() else "does not exist"
        raise DataError(f"{where}: image folder {images} {what} (file_name entries are relative to it)")

    cats = sorted(data["categories"], key=lambda c: c["id"])
    cat_to_label = {c["id"]: i for i, c in enumerate(cats)}
    img_index = {e["id"]: k for k, e in enumerate(data["images"])}
    unknown_img, unknown_cat = [], []
    for a in data["annotations"]:
        if a["image_id"] not in img_index:
            unknown_img.append(f"annotation {a['id']} -> image_id {a['image_id']}")
        if a["category_id"] not in cat_to_label:
            unknown_cat.append(f"annotation {a['id']} -> category_id {a['category_id']}")
    if unknown_img:
        raise DataError(
            f"{where}: {len(unknown_img)} annotation(s) refer to an image_id not in 'images': {_examples(unknown_img)}"
        )
    if unknown_cat:
        raise DataError(
            f"{where}: {len(unknown_cat)} annotation(s) refer to a category_id not in 'categories' (ids "
            f"{', '.join(str(c['id']) for c in cats[:10])}{', ...' if len(cats) > 10 else ''}): "
            f"{_examples(unknown_cat)}"
        )

    n_img = len(data["images"])
    per_image: list[list] = [[] for _ in range(n_img)]
    why: dict[int, str] = {}  # image index -> first problem
    n_bad_boxes = 0
    for a in data["annotations"]:
        k = img_index[a["image_id"]]
        im = data["images"][k]
        W, H = im["width"], im["height"]
        x, y, w, h = (float(v) for v in a["bbox"])
        x0, y0, x1, y1 = x, y, x + w, y + h
        t = BOX_TOLERANCE_PX
        if w <= 0 or h <= 0:
            problem = f"annotation {a['id']} bbox {a['bbox']} has a non-positive width or height"
        elif x0 < -t or y0 < -t or x1 > W + t or y1 > H + t:
            problem = f"annotation {a['id']} bbox {a['bbox']} lies outside the {W}x{H} image by more than {t:g} px"
        else:
            x0, x1 = min(max(x0, 0.0), W), min(max(x1, 0.0), W)
            y0, y1 = min(max(y0, 0.0), H), min(max(y1, 0.0), H)
            problem = None
            if x1 <= x0 or y1 <= y0:
                problem = f"annotation {a['id']} bbox {a['bbox']} has no area inside the {W}x{H} image"
        if problem is not None:
            why.setdefault(k, problem)
            n_bad_boxes += 1
            continue
        per_image[k].append((x0, y0, x1, y1, cat_to_label[a["category_id"]], bool(a.get("iscrowd", 0))))
    for k, im in enumerate(data["images"]):
        path = images / im["file_name"]
        if k not in why and not path.is_file():
            why[k] = f"file {path} {'is not a file' if path.exists() else 'does not exist'}"

    left_out = [(data["images"][k]["id"], data["images"][k]["file_name"], r) for k, r in sorted(why.items())]
    report = []
    if left_out:
        n_box = sum(1 for *_, r in left_out if r.startswith("annotation"))
        names = _examples([f"image {i} ({fn}): {r}" for i, fn, r in left_out])
        counts = f"{n_box} with a bad box ({n_bad_boxes} box(es) in all), {len(left_out) - n_box} missing file(s)"
        if len(left_out) > max_bad_fraction * n_img or len(left_out) == n_img:
            raise DataError(
                f"{where}: {len(left_out)} of {n_img} images cannot be used ({counts}), more than "
                f"max_bad_fraction={max_bad_fraction}; fix or remove them: {names}"
            )
        report.append(
            f"data: {split_name}: {len(left_out)} of {n_img} image(s) left out ({counts}; boxes may overhang by "
            f"{BOX_TOLERANCE_PX:g} px): {names}"
        )

    keep = [k for k in range(n_img) if k not in why]
    boxes, labels, crowd, crowd_labels = [], [], [], []
    start, cstart = [0], [0]
    for k in keep:
        for x0, y0, x1, y1, lab, is_crowd in per_image[k]:
            (crowd if is_crowd else boxes).append((x0, y0, x1, y1))
            (crowd_labels if is_crowd else labels).append(lab)
        start.append(len(boxes))
        cstart.append(len(crowd))
    ims = [data["images"][k] for k in keep]
    return CocoSplit(
        annotations=annotations,
        images_dir=images,
        name=split_name,
        categories=[c["name"] for c in cats],
        label_to_category_id=[c["id"] for c in cats],
        image_ids=[im["id"] for im in ims],
        paths=[str(images / im["file_name"]) for im in ims],
        sizes=[(im["height"], im["width"]) for im in ims],
        boxes=np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
        labels=np.asarray(labels, dtype=np.int64),
        box_start=np.asarray(start, dtype=np.int64),
        crowd_boxes=np.asarray(crowd, dtype=np.float32).reshape(-1, 4),
        crowd_labels=np.asarray(crowd_labels, dtype=np.int64),
        crowd_start=np.asarray(cstart, dtype=np.int64),
        left_out=left_out,
        report=report,
    )


def _subset(split: CocoSplit, keep: list[int]) -> CocoSplit:
    """``split`` restricted to the images at positions ``keep`` (in order)."""

    def gather(arr, st):
        parts = [arr[st[i] : st[i + 1]] for i in keep]
        sizes = [len(p) for p in parts]
        out = np.concatenate(parts) if parts else arr[:0]
        return out, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    boxes, start = gather(split.boxes, split.box_start)
    labels, _ = gather(split.labels, split.box_start)
    crowd, cstart = gather(split.crowd_boxes, split.crowd_start)
    clabels, _ = gather(split.crowd_labels, split.crowd_start)
    return replace(
        split,
        image_ids=[split.image_ids[i] for i in keep],
        paths=[split.paths[i] for i in keep],
        sizes=[split.sizes[i] for i in keep],
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
