"""Segmentation samples: the map-style dataset over a scanned split, the joint image+mask transforms
(torchvision.transforms.v2 with ``tv_tensors.Mask``: masks are resized with nearest, padded with
``ignore_index``) and the collate that pads a batch to a multiple of the model's stride."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from trainer.data.formats.image_decode import decode_file
from trainer.data.formats.segmentation.pairs import SegSplit, decode_mask
from trainer.data.samples import BadSample, decode_or_replace, describe_error, seeded_for_sample


class SegmentationDataset(Dataset):
    """Pairs of :class:`SegSplit`, keyed by ``(epoch, index)`` like the other formats (a plain index is epoch 0).

    ``__getitem__`` returns ``(image, mask, own_bad)``: ``image`` uint8 ``tv_tensors.Image`` (3, h, w) and ``mask``
    int64 ``tv_tensors.Mask`` (h, w) after ``transform`` (a picklable ``callable(image, mask) -> (image, mask)``),
    ``own_bad`` ``(BadSample,)`` when this index's pair was bad and replaced (training), else ``()``. ``lut``: int64
    table from the file's class ids to the run's shared ids (a multi-dataset run's class map). ``window`` > 0: a
    pair whose image is larger than ``window`` on a side is first cut to a random ``window x window`` region
    (the same for image and mask, drawn from the sample's seed), so a 10,000 px aerial tile trains at its own
    ground resolution instead of being shrunk whole by the scale jitter. Evaluation
    (``replace_bad`` False) returns the :class:`BadSample` itself; the collate drops it. Augmentation draws from
    torch's default generator seeded by (seed, epoch, index) (:func:`~trainer.data.samples.seeded_for_sample`).

    Raises:
        DataError: ``MAX_REPLACEMENTS`` consecutive pairs are bad (names the first).
    """

    MAX_REPLACEMENTS = 16

    def __init__(
        self,
        split: SegSplit,
        transform: Callable,
        num_classes: int,
        *,
        ignore_index: int = 255,
        palette: Optional[np.ndarray] = None,
        unknown_colour: str = "error",
        palette_tolerance: int = 0,
        lut: Optional[torch.Tensor] = None,
        window: int = 0,
        seed: int = 0,
        replace_bad: bool = True,
    ):
        self.split, self.transform, self.num_classes = split, transform, num_classes
        self.ignore_index, self.palette, self.unknown_colour = ignore_index, palette, unknown_colour
        self.palette_tolerance = palette_tolerance
        self.lut = lut
        self.window = window
        self.seed, self.replace_bad = seed, replace_bad

    def __len__(self) -> int:
        return len(self.split)

    def decode(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | BadSample:
        """(uint8 (3, H, W), int64 (H, W)) of pair ``index`` before any transform, or a :class:`BadSample`."""
        img_path, mask_path = self.split.images[index], self.split.masks[index]
        try:
            img = decode_file(img_path)
        except Exception as e:  # noqa: BLE001 - corrupt, truncated, too large: skip, count, report
            return BadSample(img_path, describe_error(e))
        try:
            mask = decode_mask(
                mask_path,
                self.num_classes,
                self.ignore_index,
                self.palette,
                self.unknown_colour,
                self.palette_tolerance,
            )
        except Exception as e:  # noqa: BLE001 - unreadable mask or ids outside the classes
            return BadSample(mask_path, describe_error(e))
        if tuple(mask.shape) != tuple(img.shape[1:]):
            return BadSample(mask_path, f"SizeMismatch: mask {tuple(mask.shape)} vs image {tuple(img.shape[1:])}")
        return img, (mask if self.lut is None else self.lut[mask])

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        if self.replace_bad:
            pair, _, own = decode_or_replace(self.decode, index, len(self.split), self.MAX_REPLACEMENTS)
        else:
            pair, own = self.decode(index), ()
            if isinstance(pair, BadSample):
                return pair
        img, mask = pair
        with seeded_for_sample(self.seed, epoch, index):
            h, w = int(img.shape[-2]), int(img.shape[-1])
            if self.window and max(h, w) > self.window:
                y = int(torch.randint(0, max(1, h - self.window + 1), ()))
                x = int(torch.randint(0, max(1, w - self.window + 1), ()))
                img, mask = (
                    img[:, y : y + self.window, x : x + self.window],
                    mask[y : y + self.window, x : x + self.window],
                )
            image, mask = self.transform(tv_tensors.Image(img), tv_tensors.Mask(mask))
        return image, mask, own


@dataclass(frozen=True)
class TrainTransform:
    """Scale jitter (shorter side drawn from ``scale_min..scale_max x size``, nearest for the mask), a random
    ``size x size`` crop (padded with 0 / ``ignore_index`` when the image is smaller), horizontal flip with
    ``hflip_prob``: mmsegmentation's standard training pipeline (ratio range 0.5-2.0), in torchvision v2."""

    size: int
    scale_min: float = 0.5
    scale_max: float = 2.0
    hflip_prob: float = 0.5
    ignore_index: int = 255

    def __call__(self, image, mask):
        lo = max(1, round(self.scale_min * self.size))
        hi = max(lo + 1, round(self.scale_max * self.size) + 1)
        fill = {tv_tensors.Image: 0, tv_tensors.Mask: self.ignore_index}
        return v2.Compose(
            [
                v2.RandomResize(lo, hi),
                v2.RandomCrop(self.size, pad_if_needed=True, fill=fill),
                v2.RandomHorizontalFlip(self.hflip_prob),
            ]
        )(image, mask)


@dataclass(frozen=True)
class EvalTransform:
    """Evaluation: the shorter side resized to ``size`` (mask by nearest), aspect kept; metrics are computed at
    that resolution. ``size`` 0 keeps the file's resolution."""

    size: int

    def __call__(self, image, mask):
        if not self.size:
            return image, mask
        return v2.Resize(self.size)(image, mask)


@dataclass(frozen=True)
class SegmentationCollate:
    """Stack a list of :class:`SegmentationDataset` items, padding each to the batch's largest height and width
    rounded up to a multiple of ``pad_to`` (the model's output stride: smp encoders need 32).

    Returns ``{"image": uint8 (B, 3, H, W) zeros on padding, "mask": int64 (B, H, W) ``ignore_index`` on padding,
    "size": int64 (B, 2) each item's (h, w) before padding, "source": int64 (B,) each item's dataset (items from
    :class:`~.sources.MultiSourceDataset` carry it; 0 otherwise), "bad": [BadSample, ...]}``. Bad items in
    evaluation shrink B (an all-bad batch gives B = 0).
    """

    pad_to: int = 32
    ignore_index: int = 255

    def __call__(self, items: list) -> dict:
        good = [it for it in items if not isinstance(it, BadSample)]
        bad = [it for it in items if isinstance(it, BadSample)] + [b for g in good for b in g[2]]
        if not good:
            return {
                "image": torch.empty((0, 3, 1, 1), dtype=torch.uint8),
                "mask": torch.empty((0, 1, 1), dtype=torch.int64),
                "size": torch.empty((0, 2), dtype=torch.int64),
                "source": torch.empty((0,), dtype=torch.int64),
                "bad": bad,
            }
        hmax = max(int(g[0].shape[-2]) for g in good)
        wmax = max(int(g[0].shape[-1]) for g in good)
        h, w = -(-hmax // self.pad_to) * self.pad_to, -(-wmax // self.pad_to) * self.pad_to
        images = torch.zeros((len(good), 3, h, w), dtype=torch.uint8)
        masks = torch.full((len(good), h, w), self.ignore_index, dtype=torch.int64)
        sizes = []
        for i, (img, mask, *_) in enumerate(good):
            ih, iw = int(img.shape[-2]), int(img.shape[-1])
            images[i, :, :ih, :iw] = img.as_subclass(torch.Tensor)
            masks[i, :ih, :iw] = mask.as_subclass(torch.Tensor)
            sizes.append((ih, iw))
        sources = torch.tensor([g[3] if len(g) > 3 else 0 for g in good], dtype=torch.int64)
        return {
            "image": images,
            "mask": masks,
            "size": torch.tensor(sizes, dtype=torch.int64),
            "source": sources,
            "bad": bad,
        }
