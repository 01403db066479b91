"""COCO-format object detection data: scan and validate a split, a keyed dataset, DINO's transforms, a collate.

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
  :data:`~trainer.data.formats.imagefolder.MAX_IMAGE_PIXELS`) or whose decoded size differs from the JSON's
  ``width``/``height`` (its boxes would land on the wrong pixels) is a :class:`BadSample`, as in ImageFolder:
  replaced by the next good image in training, dropped in evaluation, counted by the loop under
  ``max_bad_fraction``. :func:`check_coco_files` finds them up front for the validation split.

Transforms (``torchvision.transforms.v2`` with ``tv_tensors.BoundingBoxes``, so boxes follow every flip, resize
and crop) follow DINO's ``make_coco_transforms`` (IDEA-Research/DINO ``datasets/coco.py``, itself DETR's):
train = RandomHorizontalFlip, then one of {RandomResize(scales, max_size)} or {RandomResize([400, 500, 600]),
RandomSizeCrop(384, 600), RandomResize(scales, max_size)}, with scales 480..800 step 32, max_size 1333;
eval = RandomResize([800], max_size=1333) (shorter side 800, longer at most 1333). Every size is a parameter.
Images stay uint8 (normalisation happens on the device, as for classification).

Collate (:func:`collate_detection`) pads to the largest height and width of the batch (DETR's ``NestedTensor``),
rounded up to ``pad_to_multiple`` pixels (the config's default 64: padded sizes repeat, so compiled graphs and
autotuned kernels are reused; 1 = the exact largest size, as upstream), and returns DETR's target convention
(normalised cxcywh).
"""

from __future__ import annotations

import collections
import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from trainer.data.formats.canvases import fit_canvas
from trainer.data.formats.imagefolder import check_files, decode_file
from trainer.data.samples import BadSample, decode_or_replace, describe_error, seeded_for_sample
from trainer.errors import DataError

#: A box may overhang its image by this many pixels on any side (it is clipped); more makes the image bad.
BOX_TOLERANCE_PX = 1.0

#: How many examples a one-line error or report names.
EXAMPLES = 3

#: DINO's defaults (``make_coco_transforms``): training shorter-side scales, longest side, the crop branch's
#: first resize, its crop size range, and the evaluation shorter side (``max(scales)``).
DINO_TRAIN_SCALES = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)
DINO_MAX_SIZE = 1333
DINO_CROP_RESIZE_SCALES = (400, 500, 600)
DINO_CROP_SIZE = (384, 600)
DINO_EVAL_SIZE = 800

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


# --- dataset ----------------------------------------------------------------------------------------------
class CocoDetectionDataset(Dataset):
    """Map-style dataset over a :class:`CocoSplit`, keyed by ``(epoch, index)`` like
    :class:`~trainer.data.formats.imagefolder.ImageFolderDataset` (a plain ``index`` is epoch 0).

    Args:
        split: the scanned split.
        transform_for_epoch: ``epoch -> callable(image, target) -> (image, target)`` on a uint8
            ``tv_tensors.Image`` and ``{"boxes": tv_tensors.BoundingBoxes, "labels": int64}``
            (:func:`train_transform_for_epoch`, :func:`eval_transform_for_epoch`); picklable for loader workers.
        seed: base seed; the augmentation draws from torch's default generator seeded with
            ``sample_seed(seed, epoch, index)``, whose state is restored afterwards.
        replace_bad: training (True): an undecodable image is replaced by the next good one (index + 1, + 2,
            ... up to ``MAX_REPLACEMENTS``) and reported once by its own index; evaluation (False): a
            :class:`BadSample` is returned and the collate drops it.

    ``__getitem__((epoch, index))`` returns ``(image, target, own_bad)``: ``image`` uint8 ``tv_tensors.Image``
    (3, h, w) after the transform; ``target`` = ``{"boxes": tv_tensors.BoundingBoxes XYXY float32 (N, 4) in
    pixels of the transformed image, "labels": int64 (N,), "image_id": int (the JSON id), "orig_size": (H, W)
    of the file}``; ``own_bad``: ``(BadSample,)`` when this index's own file was bad and replaced, else ``()``.
    Before the transform the boxes are those of :meth:`CocoSplit.targets` (pixels of the file).

    Raises:
        DataError: ``MAX_REPLACEMENTS`` consecutive images are bad (names the first).
    """

    MAX_REPLACEMENTS = 16

    def __init__(
        self, split: CocoSplit, transform_for_epoch: Callable[[int], Callable], seed: int = 0, replace_bad: bool = True
    ):
        self.split = split
        self.transform_for_epoch = transform_for_epoch
        self.seed = seed
        self.replace_bad = replace_bad

    def __len__(self) -> int:
        return len(self.split)

    def _decode(self, index: int) -> torch.Tensor | BadSample:
        path = self.split.paths[index]
        try:
            img = decode_file(path)
        except Exception as e:  # noqa: BLE001 - corrupt, truncated, too large or unsupported: skip, count, report
            return BadSample(path, describe_error(e))
        h, w = self.split.sizes[index]
        if tuple(img.shape[1:]) != (h, w):
            return BadSample(
                path,
                f"SizeMismatch: decoded {img.shape[2]}x{img.shape[1]} but {self.split.annotations.name} says "
                f"width={w} height={h} (its boxes would be misplaced)",
            )
        return img

    def raw_target(self, index: int) -> dict:
        """The target of image ``index`` before any transform (see the class docstring)."""
        boxes, labels = self.split.targets(index)
        h, w = self.split.sizes[index]
        return {
            "boxes": tv_tensors.BoundingBoxes(torch.from_numpy(boxes.copy()), format="XYXY", canvas_size=(h, w)),
            "labels": torch.from_numpy(labels.copy()),
            "image_id": self.split.image_ids[index],
            "orig_size": (h, w),
        }

    def transformed_size(self, epoch: int, index: int) -> tuple[int, int]:
        """(h, w) in pixels of image ``index`` after epoch ``epoch``'s transform, without decoding it: the same
        transform, with the same seeded draws, run on the image's boxes alone (v2 transforms take the size from
        their ``canvas_size``). Equal to ``self[(epoch, index)][0].shape[-2:]`` for a readable file."""
        target = self.raw_target(index)
        with seeded_for_sample(self.seed, epoch, index):
            labels = target["labels"].as_subclass(tv_tensors.TVTensor)  # not a pure tensor: not taken for an image
            out = self.transform_for_epoch(epoch)({"boxes": target["boxes"], "labels": labels})
        return tuple(int(x) for x in out["boxes"].canvas_size)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        if not self.replace_bad:
            img, used, own = self._decode(index), index, ()
            if isinstance(img, BadSample):
                return img
        else:
            img, used, own = decode_or_replace(self._decode, index, len(self.split), self.MAX_REPLACEMENTS)
        target = self.raw_target(used)
        transform = self.transform_for_epoch(epoch)
        with seeded_for_sample(self.seed, epoch, index):
            image, out = transform(tv_tensors.Image(img), {"boxes": target["boxes"], "labels": target["labels"]})
        target.update(boxes=out["boxes"], labels=out["labels"])
        return image, target, own


# --- transforms -------------------------------------------------------------------------------------------
def _image_size(flat_inputs: list) -> tuple[int, int]:
    for x in flat_inputs:
        if isinstance(x, (tv_tensors.Image, tv_tensors.BoundingBoxes)):
            return tuple(F.get_size(x))
    raise TypeError("RandomSizeCrop: no tv_tensors.Image or BoundingBoxes among the inputs")


class RandomSizeCrop(v2.Transform):
    """DETR/DINO's ``RandomSizeCrop(min_size, max_size)`` in transforms.v2: a crop of width drawn uniformly in
    ``[min_size, min(W, max_size)]`` and height in ``[min_size, min(H, max_size)]`` (both in pixels, drawn from
    torch's generator; a side shorter than ``min_size`` is kept whole), at a uniform position. Boxes are
    shifted and clipped by ``F.crop``; boxes left degenerate are removed later by ``SanitizeBoundingBoxes``."""

    def __init__(self, min_size: int, max_size: int):
        super().__init__()
        if not 0 < min_size <= max_size:
            raise ValueError(f"RandomSizeCrop: need 0 < min_size <= max_size, got {min_size}, {max_size}")
        self.min_size, self.max_size = int(min_size), int(max_size)

    def make_params(self, flat_inputs: list) -> dict:
        h, w = _image_size(flat_inputs)
        ch_hi, cw_hi = min(h, self.max_size), min(w, self.max_size)
        ch = int(torch.randint(min(self.min_size, ch_hi), ch_hi + 1, ()))
        cw = int(torch.randint(min(self.min_size, cw_hi), cw_hi + 1, ()))
        top = int(torch.randint(0, h - ch + 1, ()))
        left = int(torch.randint(0, w - cw + 1, ()))
        return dict(top=top, left=left, height=ch, width=cw)

    def transform(self, inpt, params: dict):
        return self._call_kernel(F.crop, inpt, **params)


def _sizes(name: str, values: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)
    if not out or any(v <= 0 for v in out):
        raise ValueError(f"{name}: expected a non-empty list of positive pixel sizes, got {list(values)}")
    return out


@functools.lru_cache(maxsize=16)
def train_transform(
    train_scales: tuple[int, ...] = DINO_TRAIN_SCALES,
    max_size: int = DINO_MAX_SIZE,
    crop_resize_scales: tuple[int, ...] = DINO_CROP_RESIZE_SCALES,
    crop_size: tuple[int, int] = DINO_CROP_SIZE,
    hflip_prob: float = 0.5,
    crop_prob: float = 0.5,
) -> v2.Compose:
    """DINO's training augmentation on ``(uint8 Image, {"boxes", "labels"})``, all sizes in pixels:

    RandomHorizontalFlip(hflip_prob); then, with probability 1 - crop_prob and crop_prob (DINO: 1/2 each), either
    RandomShortestSize(train_scales,
    max_size) (shorter side drawn from ``train_scales``, longer side at most ``max_size``), or
    RandomShortestSize(crop_resize_scales) -> :class:`RandomSizeCrop` (``crop_size`` = (min, max)) ->
    RandomShortestSize(train_scales, max_size); then SanitizeBoundingBoxes (drops boxes under 1 px and their
    labels). v2's RandomShortestSize truncates the new sizes (``int``) where DETR's RandomResize rounds the
    longer side: sizes may differ by one pixel.
    """
    scales, crop_scales = _sizes("train_scales", train_scales), _sizes("crop_resize_scales", crop_resize_scales)
    lo, hi = _sizes("crop_size", crop_size)
    resize = v2.RandomShortestSize(list(scales), max_size=max_size, antialias=True)
    return v2.Compose(
        [
            v2.RandomHorizontalFlip(hflip_prob),
            v2.RandomChoice(
                [
                    resize,
                    v2.Compose(
                        [v2.RandomShortestSize(list(crop_scales), antialias=True), RandomSizeCrop(lo, hi), resize]
                    ),
                ],
                p=[1.0 - crop_prob, crop_prob],
            ),
            v2.SanitizeBoundingBoxes(),
        ]
    )


@functools.lru_cache(maxsize=16)
def eval_transform(eval_size: int = DINO_EVAL_SIZE, max_size: int = DINO_MAX_SIZE) -> v2.Compose:
    """Shorter side to ``eval_size`` pixels, longer side at most ``max_size`` (DINO's
    ``RandomResize([max(scales)], max_size)``); deterministic, boxes scaled along, none dropped."""
    (size,) = _sizes("eval_size", [eval_size])
    return v2.Compose([v2.RandomShortestSize([size], max_size=max_size, antialias=True)])


@dataclass(frozen=True)
class _TrainForEpoch:
    train_scales: tuple[int, ...]
    max_size: int
    crop_resize_scales: tuple[int, ...]
    crop_size: tuple[int, int]
    hflip_prob: float
    crop_prob: float = 0.5

    def __call__(self, epoch: int) -> v2.Compose:
        return train_transform(
            self.train_scales, self.max_size, self.crop_resize_scales, self.crop_size, self.hflip_prob, self.crop_prob
        )


@dataclass(frozen=True)
class _EvalForEpoch:
    eval_size: int
    max_size: int

    def __call__(self, epoch: int) -> v2.Compose:
        return eval_transform(self.eval_size, self.max_size)


def train_transform_for_epoch(
    train_scales: Sequence[int] = DINO_TRAIN_SCALES,
    max_size: int = DINO_MAX_SIZE,
    crop_resize_scales: Sequence[int] = DINO_CROP_RESIZE_SCALES,
    crop_size: Sequence[int] = DINO_CROP_SIZE,
    hflip_prob: float = 0.5,
    crop_prob: float = 0.5,
) -> Callable[[int], v2.Compose]:
    """Picklable ``epoch -> transform`` for :class:`CocoDetectionDataset` in training (:func:`train_transform`;
    the same every epoch). Sizes in pixels; ``crop_size`` = (min, max) side of the random crop; ``hflip_prob`` and
    ``crop_prob`` (the crop branch's share) in [0, 1].

    Raises:
        ValueError: an empty or non-positive size list, ``crop_size`` not (min <= max).
    """
    f = _TrainForEpoch(
        _sizes("train_scales", train_scales),
        int(max_size),
        _sizes("crop_resize_scales", crop_resize_scales),
        tuple(_sizes("crop_size", crop_size)),
        float(hflip_prob),
        float(crop_prob),
    )
    if len(f.crop_size) != 2 or f.crop_size[0] > f.crop_size[1]:
        raise ValueError(f"crop_size: expected [min, max] with min <= max, got {list(crop_size)}")
    f(0)  # build once: bad values fail here, not in a worker
    return f


def eval_transform_for_epoch(eval_size: int = DINO_EVAL_SIZE, max_size: int = DINO_MAX_SIZE) -> Callable:
    """Picklable ``epoch -> transform`` for evaluation (:func:`eval_transform`)."""
    f = _EvalForEpoch(int(eval_size), int(max_size))
    f(0)
    return f


# --- collate ----------------------------------------------------------------------------------------------
def _xyxy_to_cxcywh_normalised(boxes: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b = boxes.as_subclass(torch.Tensor).to(torch.float32).reshape(-1, 4)
    x0, y0, x1, y1 = b.unbind(-1)
    out = torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)
    return out / torch.tensor([w, h, w, h], dtype=torch.float32)


def collate_detection(items: list, pad_to_multiple: int = 1, canvases: Sequence[tuple[int, int]] = ()) -> dict:
    """Pad a list of :class:`CocoDetectionDataset` items into one batch (DETR's NestedTensor convention).

    ``pad_to_multiple``: Hmax and Wmax are rounded up to a multiple of it (1: the exact largest size); bind it
    with ``functools.partial`` for a DataLoader. ``canvases``: (H, W) pairs; when given, (Hmax, Wmax) is instead
    the smallest-area canvas that holds the batch (:func:`~trainer.data.formats.canvases.fit_canvas`), so a run
    sees only those shapes (a batch no canvas holds keeps its own padded size).

    Returns::

        {"image":   uint8 (B, 3, Hmax, Wmax), each image at the top-left, zeros bottom/right (Hmax, Wmax: the
                    largest height and width in the batch, rounded up to a multiple of ``pad_to_multiple``),
         "mask":    bool (B, Hmax, Wmax), True on padding, False on image pixels,
         "targets": [{"boxes": float32 (N, 4) cx, cy, w, h normalised by the unpadded transformed image's width
                      and height (0..1), "labels": int64 (N,), "image_id": int, "orig_size": int64 (2,) (H, W)
                      of the file, "size": int64 (2,) (h, w) after the transform}, ...] (B dicts),
         "bad":     [BadSample, ...]}

    In training B is the micro-batch (bad files were replaced and are listed once, by their own index); in
    evaluation the dropped files shrink B. An all-bad batch gives B = 0 (image (0, 3, 1, 1)).
    """
    good = [it for it in items if not isinstance(it, BadSample)]
    bad = [it for it in items if isinstance(it, BadSample)] + [b for g in good for b in g[2]]
    if not good:
        return {
            "image": torch.empty((0, 3, 1, 1), dtype=torch.uint8),
            "mask": torch.empty((0, 1, 1), dtype=torch.bool),
            "targets": [],
            "bad": bad,
        }
    if pad_to_multiple < 1:
        raise ValueError(f"collate_detection: pad_to_multiple must be >= 1, got {pad_to_multiple}")
    hmax = -(-max(int(g[0].shape[-2]) for g in good) // pad_to_multiple) * pad_to_multiple
    wmax = -(-max(int(g[0].shape[-1]) for g in good) // pad_to_multiple) * pad_to_multiple
    if canvases:
        hmax, wmax = fit_canvas(hmax, wmax, canvases) or (hmax, wmax)
    images = torch.zeros((len(good), 3, hmax, wmax), dtype=torch.uint8)
    mask = torch.ones((len(good), hmax, wmax), dtype=torch.bool)
    targets = []
    for i, (img, tgt, _) in enumerate(good):
        h, w = int(img.shape[-2]), int(img.shape[-1])
        images[i, :, :h, :w] = img.as_subclass(torch.Tensor)
        mask[i, :h, :w] = False
        targets.append(
            {
                "boxes": _xyxy_to_cxcywh_normalised(tgt["boxes"], h, w),
                "labels": tgt["labels"].as_subclass(torch.Tensor).to(torch.int64),
                "image_id": int(tgt["image_id"]),
                "orig_size": torch.as_tensor(tgt["orig_size"], dtype=torch.int64),
                "size": torch.tensor([h, w], dtype=torch.int64),
            }
        )
    return {"image": images, "mask": mask, "targets": targets, "bad": bad}
