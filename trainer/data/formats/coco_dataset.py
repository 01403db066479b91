"""A scanned COCO split as training data: the keyed dataset, DINO's transforms and the collate.

The split itself (reading and validating the annotations JSON, the bad-input policy) is
:mod:`trainer.data.formats.coco`. While loading, a file that cannot be decoded or whose decoded size differs
from the JSON's is a :class:`BadSample` (replaced in training, dropped in evaluation).

Transforms (``torchvision.transforms.v2`` with ``tv_tensors.BoundingBoxes``, so boxes follow every flip, resize
and crop) follow DINO's ``make_coco_transforms`` (IDEA-Research/DINO ``datasets/coco.py``, itself DETR's):
train = RandomHorizontalFlip, then one of {RandomResize(scales, max_size)} or {RandomResize([400, 500, 600]),
RandomSizeCrop(384, 600), RandomResize(scales, max_size)}, with scales 480..800 step 32, max_size 1333;
eval = RandomResize([800], max_size=1333) (shorter side 800, longer at most 1333). Every size is a parameter.
Images stay uint8 (normalisation happens on the device, as for classification).

Collate (:func:`collate_detection`) pads to the largest height and width of the batch (DETR's ``NestedTensor``),
rounded up to ``pad_to_multiple`` pixels (the config's default 64: padded sizes repeat, so compiled graphs and
autotuned kernels are reused; 1 = the exact largest size, as upstream), and returns DETR's target convention
(normalised cxcywh). The padding value (:data:`PAD_VALUES`, the config's ``pad_value``) is chosen there too:
``mean``, upstream DINO's (its ``nested_tensor_from_tensor_list`` pads the *normalised* image with 0, i.e. the
ImageNet mean colour), or ``black`` (pixel 0 before normalisation, -2.1/-2.0/-1.8 after). Padding reaches every
encoder token through the input projections' GroupNorm, so weights trained with one value see a shift with the
other; :func:`fill_padding` makes the normalised padding exactly 0 on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from trainer.data.formats.canvases import fit_canvas
from trainer.data.formats.coco import CocoSplit
from trainer.data.formats.image_decode import decode_file
from trainer.data.samples import BadSample, decode_or_replace, describe_error, seeded_for_sample

#: Padding values of :func:`collate_detection`: the mean colour (0 after normalisation, upstream DINO) or black.
PAD_VALUES = ("mean", "black")
#: The ImageNet mean colour as uint8 pixels (round(255 x (0.485, 0.456, 0.406))): the host-side padding of ``mean``.
MEAN_PIXEL = (124, 116, 104)

#: DINO's defaults (``make_coco_transforms``): training shorter-side scales, longest side, the crop branch's
#: first resize, its crop size range, and the evaluation shorter side (``max(scales)``).
DINO_TRAIN_SCALES = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)
DINO_MAX_SIZE = 1333
DINO_CROP_RESIZE_SCALES = (400, 500, 600)
DINO_CROP_SIZE = (384, 600)
DINO_EVAL_SIZE = 800


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


def fill_padding(images: torch.Tensor, mask: torch.Tensor, pad_value: str) -> torch.Tensor:
    """Normalised float images (B, 3, H, W) with their padding (``mask`` bool (B, H, W), True on padding) set to
    exactly 0 for ``pad_value`` ``mean`` (the uint8 mean pixel normalises to within 0.006 of 0; upstream pads the
    normalised tensor with 0); unchanged for ``black``. In place; returns ``images``."""
    if pad_value == "mean" and images.numel():
        images.masked_fill_(mask.unsqueeze(1).to(images.device), 0.0)
    return images


def collate_detection(
    items: list, pad_to_multiple: int = 1, canvases: Sequence[tuple[int, int]] = (), pad_value: str = "mean"
) -> dict:
    """Pad a list of :class:`CocoDetectionDataset` items into one batch (DETR's NestedTensor convention).

    ``pad_to_multiple``: Hmax and Wmax are rounded up to a multiple of it (1: the exact largest size); bind it
    with ``functools.partial`` for a DataLoader. ``canvases``: (H, W) pairs; when given, (Hmax, Wmax) is instead
    the smallest-area canvas that holds the batch (:func:`~trainer.data.formats.canvases.fit_canvas`), so a run
    sees only those shapes (a batch no canvas holds keeps its own padded size). ``pad_value``
    (:data:`PAD_VALUES`): what the padding holds, per-batch padding and canvases alike.

    Returns::

        {"image":   uint8 (B, 3, Hmax, Wmax), each image at the top-left, the padding bottom/right
                    (:data:`MEAN_PIXEL` for ``mean``, zeros for ``black``; Hmax, Wmax: the
                    largest height and width in the batch, rounded up to a multiple of ``pad_to_multiple``),
         "pad_value": ``pad_value`` (the device step's :func:`fill_padding` makes ``mean`` exactly 0),
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
            "pad_value": pad_value,
        }
    if pad_value not in PAD_VALUES:
        raise ValueError(f"collate_detection: pad_value must be one of {', '.join(PAD_VALUES)}, got {pad_value!r}")
    if pad_to_multiple < 1:
        raise ValueError(f"collate_detection: pad_to_multiple must be >= 1, got {pad_to_multiple}")
    hmax = -(-max(int(g[0].shape[-2]) for g in good) // pad_to_multiple) * pad_to_multiple
    wmax = -(-max(int(g[0].shape[-1]) for g in good) // pad_to_multiple) * pad_to_multiple
    if canvases:
        hmax, wmax = fit_canvas(hmax, wmax, canvases) or (hmax, wmax)
    images = torch.zeros((len(good), 3, hmax, wmax), dtype=torch.uint8)
    if pad_value == "mean":
        images[:] = torch.tensor(MEAN_PIXEL, dtype=torch.uint8).view(1, 3, 1, 1)
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
    return {"image": images, "mask": mask, "targets": targets, "bad": bad, "pad_value": pad_value}
