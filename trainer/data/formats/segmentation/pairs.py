"""Semantic segmentation data: image/mask pairs from folders, class-index or palette masks, joint transforms.

A split is a list of (image, mask) file pairs found by a pairing rule (:class:`PairingRule`): the mask of image
``<images>/<stem>.<ext>`` is ``<masks>/<stem><mask_suffix>.<any image extension>``. The rules users meet:

* RID (``../shared/data/rid-roofs``): ``images/N.png`` <-> ``masks/N_reviewed.png`` (``mask_suffix: _reviewed``);
* AIRS: ``<split>/image/X.tif`` <-> ``<split>/label/X.tif`` (``seg_images: "{split}/image"``, ``seg_masks:
  "{split}/label"``);
* a plain ``images/`` <-> ``masks/`` same-stem folder pair (the defaults);
* R3D floor plans: ``N.jpg`` <-> ``N_rooms.png`` in one folder (``image_glob: "*.jpg"``, ``mask_suffix: _rooms``,
  a palette, since the masks are colour images).

Folders without ``{split}`` hold one pool of pairs; ``val_fraction`` of them (chosen by a hash of the file name,
so adding files moves no other pair) form the val split.

Bad input policy (as classification and detection): a pair problem found while scanning (an image without a
mask, a mask without an image, two candidate masks, an unreadable header, image and mask of different sizes) is
named, counted and skipped; more than ``max_bad_fraction`` of the candidates fail the scan with a
:class:`~trainer.errors.DataError` naming examples. A file that fails to decode, or a mask with ids outside the
declared classes (or colours outside the palette), is a :class:`~trainer.data.samples.BadSample` at load time:
replaced in training, dropped in evaluation, counted by the engine.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image

from trainer.data.samples import describe_error
from trainer.errors import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp")
EXAMPLES = 3


@dataclass(frozen=True)
class PairingRule:
    """Where one dataset's pairs are: folder templates relative to ``root`` (``{split}`` allowed), the mask
    suffix, and a file-name filter for the images (fnmatch pattern)."""

    root: Path
    images: str = "images"
    masks: str = "masks"
    mask_suffix: str = ""
    image_glob: str = "*"

    def folders(self, split: str) -> tuple[Path, Path]:
        """(image folder, mask folder) of ``split``."""
        return self.root / self.images.format(split=split), self.root / self.masks.format(split=split)

    @property
    def has_splits(self) -> bool:
        """True when the folders differ per split (a ``{split}`` in either template)."""
        return "{split}" in self.images or "{split}" in self.masks


@dataclass
class SegSplit:
    """The usable pairs of one split: parallel lists of image and mask paths and their (H, W) in pixels, and the
    scan's report lines (skipped pairs, by reason)."""

    name: str
    images: list[str]
    masks: list[str]
    sizes: list[tuple[int, int]]
    report: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.images)


def parse_palette(palette: list, num_classes: int) -> np.ndarray:
    """uint8 (num_classes, 3) colours from ``["R,G,B", ...]`` (or ``"#rrggbb"``) in class order.

    Raises:
        DataError: not one colour per class, a value outside 0..255, or two classes with one colour.
    """
    rows = []
    for i, item in enumerate(palette):
        text = str(item).strip()
        try:
            rgb = (
                [int(text[k : k + 2], 16) for k in (1, 3, 5)]
                if text.startswith("#")
                else [int(x) for x in text.split(",")]
            )
        except ValueError:
            rgb = []
        if len(rgb) != 3 or not all(0 <= v <= 255 for v in rgb):
            raise DataError(f"segmentation.palette[{i}]: got {item!r}; expected R,G,B with each in 0..255")
        rows.append(rgb)
    if len(rows) != num_classes:
        raise DataError(f"segmentation.palette: {len(rows)} colours for {num_classes} classes; give one per class")
    arr = np.asarray(rows, dtype=np.uint8)
    if len({tuple(r) for r in rows}) != len(rows):
        raise DataError("segmentation.palette: two classes share one colour; each class needs its own")
    return arr


def _header_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        w, h = im.size
    return h, w


def _hash_unit(name: str) -> float:
    """A stable number in [0, 1) from a file name (SHA-1), to draw the val share of a pooled folder."""
    return int(hashlib.sha1(name.encode()).hexdigest()[:12], 16) / 16**12


def _examples(items: list[str]) -> str:
    more = f" (+{len(items) - EXAMPLES} more)" if len(items) > EXAMPLES else ""
    return "; ".join(items[:EXAMPLES]) + more


def scan_pairs(
    rule: PairingRule, split: str, max_bad_fraction: float, *, val_fraction: float = 0.0, max_samples: int = 0
) -> SegSplit:
    """Find and check the pairs of ``split`` (``train_split`` or ``val_split`` names; with pooled folders
    "train" is every pair not drawn for val and any other name is the val share).

    Reads file headers only (PIL), not pixels. ``max_samples`` > 0 keeps the first pairs in name order.

    Raises:
        DataError: a folder is missing, no pair is usable, more than ``max_bad_fraction`` of the candidates are
            bad (examples named), or pooled folders without ``val_fraction`` in (0, 1).
    """
    img_dir, mask_dir = rule.folders(split)
    for what, d in (("seg_images", img_dir), ("seg_masks", mask_dir)):
        if not d.is_dir():
            raise DataError(f"{what}: {d} is not a folder (split {split}, data_dir {rule.root})")
    if not rule.has_splits and not 0 < val_fraction < 1:
        raise DataError(
            f"segmentation: {img_dir} has no per-split folders ({{split}} in seg_images/seg_masks); set val_fraction "
            "in (0, 1) to hold out a share of the pairs for validation"
        )
    files = sorted(p for p in img_dir.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    same = img_dir.resolve() == mask_dir.resolve()
    suffix = rule.mask_suffix
    masks_by_stem: dict[str, list[Path]] = {}
    for p in sorted(mask_dir.iterdir()) if not same else files:
        if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file() and p.stem.endswith(suffix):
            masks_by_stem.setdefault(p.stem[: len(p.stem) - len(suffix)] if suffix else p.stem, []).append(p)
    images = [p for p in files if fnmatch.fnmatch(p.name, rule.image_glob) and not (same and p.stem.endswith(suffix))]
    if same and not suffix:
        raise DataError("mask_suffix: images and masks share one folder, so masks need a suffix (e.g. _rooms)")
    problems: dict[str, list[str]] = {}
    pairs: list[tuple[Path, Path, tuple[int, int]]] = []
    for img in images:
        cands = masks_by_stem.get(img.stem, [])
        if not cands:
            problems.setdefault("image without a mask", []).append(f"{img} (no {img.stem}{suffix}.* in {mask_dir})")
            continue
        if len(cands) > 1:
            problems.setdefault("several masks", []).append(f"{img}: {', '.join(p.name for p in cands)}")
            continue
        try:
            hw, mhw = _header_size(img), _header_size(cands[0])
        except Exception as e:  # noqa: BLE001 - unreadable header: name it, skip the pair
            problems.setdefault("unreadable file", []).append(f"{img} or {cands[0]} ({describe_error(e)})")
            continue
        if hw != mhw:
            problems.setdefault("size mismatch", []).append(
                f"{img} is {hw[1]}x{hw[0]} but {cands[0].name} is {mhw[1]}x{mhw[0]}"
            )
            continue
        pairs.append((img, cands[0], hw))
    all_stems = {p.stem for p in files}
    orphans = sorted(str(m) for stem, ms in masks_by_stem.items() if stem not in all_stems for m in ms)
    if orphans:
        problems["mask without an image"] = orphans
    bad = sum(len(v) for v in problems.values())
    total = len(pairs) + bad
    report = [f"data: {split}: skipped {len(v)} ({reason}): {_examples(v)}" for reason, v in problems.items()]
    if total and bad / total > max_bad_fraction:
        raise DataError(
            f"segmentation: {bad} of {total} candidate pairs of split {split} are bad, more than max_bad_fraction "
            f"{max_bad_fraction:g}; first: " + " | ".join(r.split(": ", 2)[2] for r in report[:2])
        )
    if not rule.has_splits:
        val = {str(p[0]) for p in pairs if _hash_unit(p[0].name) < val_fraction}
        pairs = [p for p in pairs if (str(p[0]) in val) != (split == "train")]
    if max_samples:
        pairs = pairs[:max_samples]
    if not pairs:
        raise DataError(
            f"segmentation: no usable image/mask pair in {img_dir} and {mask_dir} (split {split})"
            + (f"; {report[0][len('data: ') :]}" if report else "")
        )
    return SegSplit(split, [str(p[0]) for p in pairs], [str(p[1]) for p in pairs], [p[2] for p in pairs], report)


def decode_mask(
    path: str,
    num_classes: int,
    ignore_index: int,
    palette: Optional[np.ndarray] = None,
    unknown: str = "error",
    tolerance: int = 0,
) -> torch.Tensor:
    """int64 (H, W) class ids of a mask file: the stored values of a class-index image (modes L, P, I;16, I), or
    with ``palette`` (uint8 (C, 3)) each pixel's nearest palette colour when no channel differs by more than
    ``tolerance`` (lossy or re-encoded colour masks drift by a level or two: R3D has (225, 255, 193) beside
    (224, 255, 192)). Values must be < ``num_classes`` or ``ignore_index``.

    Raises:
        ValueError: ids outside the classes, colours outside the palette (``unknown`` "error"; "ignore" maps
            them to ``ignore_index``), or a colour mask without a palette (the message names what was found).
    """
    with Image.open(path) as im:
        if palette is not None:
            rgb = np.asarray(im.convert("RGB")).reshape(-1, 3).astype(np.int32)
            codes, inverse = np.unique((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2], return_inverse=True)
            colours = np.stack([codes >> 16, (codes >> 8) & 255, codes & 255], 1)
            dist = np.abs(colours[:, None, :].astype(np.int64) - palette[None].astype(np.int64)).max(-1)
            nearest = dist.argmin(1)
            found = dist[np.arange(len(colours)), nearest] <= tolerance
            if unknown == "error" and not found.all():
                counts = np.bincount(inverse.reshape(-1), minlength=len(colours))
                worst = np.argsort(-counts * ~found)[: min(EXAMPLES, int((~found).sum()))]
                shown = ", ".join(f"({','.join(str(int(v)) for v in colours[k])}): {counts[k]} px" for k in worst)
                raise ValueError(f"colours not in the palette (tolerance {tolerance}): {shown}")
            ids = np.where(found, nearest, ignore_index)[inverse.reshape(-1)]
            return torch.from_numpy(ids.astype(np.int64).reshape(im.size[1], im.size[0]))
        if im.mode in ("RGB", "RGBA", "LA", "CMYK", "YCbCr"):
            raise ValueError(f"a colour mask (mode {im.mode}) but no palette: set segmentation.palette")
        raw = np.asarray(im)
    if np.issubdtype(raw.dtype, np.floating) and not np.array_equal(raw, np.floor(raw)):
        vals = np.unique(raw[raw != np.floor(raw)])[:EXAMPLES].tolist()
        raise ValueError(f"a float mask with fractional values {vals}; expected whole class ids")
    ids = raw.astype(np.int64)
    if ids.ndim != 2:
        raise ValueError(f"expected a single-channel mask, got shape {ids.shape}")
    outside = ((ids >= num_classes) & (ids != ignore_index)) | (ids < 0)
    if outside.any():
        vals = np.unique(ids[outside])[:EXAMPLES].tolist()
        raise ValueError(f"class ids {vals} outside 0..{num_classes - 1} (ignore_index {ignore_index})")
    return torch.from_numpy(ids)


def check_val_masks(
    split: SegSplit,
    decode: Callable[[str], torch.Tensor],
    ignore_index: int,
    max_bad_fraction: float,
    limit: int = 1000,
) -> tuple[SegSplit, list[str], int]:
    """Decode the masks of a val split before training (the first ``limit`` pairs; classification and detection
    check their val images the same way), so a mask with ids outside the classes, colours outside the palette or
    an unreadable file is named and left out now, not found after an epoch of training.

    ``decode(mask_path)`` -> int64 (H, W) class ids (raises ValueError/OSError for a bad mask).

    Returns ``(split without the bad pairs, report lines, number left out)``.

    Raises:
        DataError: more than ``max_bad_fraction`` of the checked masks are bad (examples named), or every checked
            mask is ``ignore_index`` only (mIoU would be computed over no pixel).
    """
    n = min(len(split), limit)
    bad: list[tuple[int, str]] = []
    labelled = 0
    for i in range(n):
        try:
            mask = decode(split.masks[i])
        except Exception as e:  # noqa: BLE001 - any unreadable or invalid mask is named and left out
            bad.append((i, f"{split.masks[i]} ({describe_error(e)})"))
            continue
        labelled += int(bool((mask != ignore_index).any()))
    names = _examples([b for _, b in bad])
    if bad and (len(bad) > max_bad_fraction * n or len(bad) == n):
        raise DataError(
            f"segmentation: {len(bad)} of {n} val masks of split {split.name} are bad, more than max_bad_fraction "
            f"{max_bad_fraction:g}; fix or remove them: {names}"
        )
    if n and not labelled:
        raise DataError(
            f"segmentation: every val mask of split {split.name} ({n} checked) is ignore_index {ignore_index} only; "
            "mIoU needs labelled pixels (check seg_masks, the palette or ignore_index)"
        )
    if not bad:
        return split, [], 0
    drop = {i for i, _ in bad}
    keep = [i for i in range(len(split)) if i not in drop]
    kept = SegSplit(
        split.name,
        [split.images[i] for i in keep],
        [split.masks[i] for i in keep],
        [split.sizes[i] for i in keep],
        split.report,
    )
    line = f"data: {split.name}: {len(bad)} of {n} val mask(s) cannot be used; left out: {names}"
    return kept, [line], len(bad)
