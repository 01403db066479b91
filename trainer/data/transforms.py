"""Standard ImageNet train/val transforms on uint8 tensors (torchvision.transforms.v2), plus the
progressive-resize schedule and the on-device normalisation.

Train: RandomResizedCrop(size, scale=(crop_scale_min, 1), bilinear, antialias) + horizontal flip.
Val: resize the shorter side to ``size / val_resize_ratio`` (256 for 224), centre-crop ``size``.
Both return uint8 (3, size, size); :func:`normalize_on_device` turns a uint8 batch into a normalised float
batch on the training device (ImageNet mean/std, as in torchvision's reference scripts).
"""

from __future__ import annotations

import functools

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def progressive_size(epoch: int, epochs: int, min_size: int, max_size: int, stages: int) -> int:
    """Training resolution (pixels) at ``epoch`` (0-based) for progressive resizing.

    The epochs are split into ``stages`` equal parts whose sizes go linearly from ``min_size`` to
    ``max_size``, rounded down to a multiple of 16 (last stage exactly ``max_size``). Seed 003's schedule
    (60 epochs, 160 -> 224, 3 stages) gives 160 for epochs 0-19, 192 for 20-39 and 224 for 40-59.
    """
    if stages <= 1 or min_size >= max_size:
        return max_size
    stage = min(stages - 1, epoch * stages // max(epochs, 1))
    if stage == stages - 1:
        return max_size
    size = min_size + (max_size - min_size) * stage / (stages - 1)
    return max(16, int(size) // 16 * 16)


def train_size_for_epoch(cfg, epoch: int) -> int:
    """Training resolution of ``epoch`` for a TrainConfig: the progressive schedule when
    ``progressive_resize`` is on, else ``image_size``."""
    stages = cfg.progressive_stages if cfg.progressive_resize else 1
    return progressive_size(epoch, cfg.epochs, cfg.progressive_min_size, cfg.image_size, stages)


@functools.lru_cache(maxsize=16)
def train_transform(size: int, crop_scale_min: float, hflip_prob: float) -> v2.Compose:
    """uint8 (3,H,W) -> uint8 (3,size,size): RandomResizedCrop + RandomHorizontalFlip."""
    steps = [v2.RandomResizedCrop(size, scale=(crop_scale_min, 1.0), antialias=True)]
    if hflip_prob > 0:
        steps.append(v2.RandomHorizontalFlip(hflip_prob))
    return v2.Compose(steps)


@functools.lru_cache(maxsize=16)
def val_transform(size: int, resize_ratio: float) -> v2.Compose:
    """uint8 (3,H,W) -> uint8 (3,size,size): Resize(round(size / resize_ratio)) + CenterCrop(size)."""
    return v2.Compose([v2.Resize(int(round(size / resize_ratio)), antialias=True), v2.CenterCrop(size)])


def pixel_mean_std(device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """ImageNet mean and std on the 0-255 pixel scale: float32 (3, 1, 1) each, on ``device`` (broadcast over
    (B, 3, H, W) images and (B, T, 3, H, W) clips)."""
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(3, 1, 1) * 255.0
    std = torch.tensor(IMAGENET_STD, device=device).view(3, 1, 1) * 255.0
    return mean, std


@functools.lru_cache(maxsize=8)
def _mean_inv_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = pixel_mean_std(device)
    return mean.view(1, 3, 1, 1), 1.0 / std.view(1, 3, 1, 1)


def normalize_on_device(images: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    """uint8 (B,3,H,W) on host -> float32 (B,3,H,W) on ``device``, ImageNet-normalised.

    The copy moves uint8 (4x fewer bytes than float32) and is non-blocking (asynchronous on CUDA when the
    host batch is pinned); the layout change happens on uint8, the normalisation in place in two passes.
    """
    x = images.to(device, non_blocking=True)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    mean, inv_std = _mean_inv_std(device)
    return x.float().sub_(mean).mul_(inv_std)


#: One sample's training crop, drawn in a loader worker and applied on the training device:
#: ``(top, left, height, width, flip, out_height, out_width)`` in pixels (top/left/height/width of the box in
#: the decoded image, flip 0 or 1, then the output size: the epoch's training size).
CropParams = tuple[int, int, int, int, int, int, int]


def draw_train_crop(transform: v2.Compose, height: int, width: int) -> CropParams:
    """The crop and flip that ``transform(img)`` would apply to a (3, ``height``, ``width``) image, drawn
    without the image.

    ``transform`` is a :func:`train_transform` (RandomResizedCrop, then RandomHorizontalFlip when
    ``hflip_prob > 0``). The draws come from torch's default CPU generator in the same order and number as
    ``transform(img)`` makes them (torchvision 0.29's ``RandomResizedCrop.make_params``, which reads only the
    input's size, then ``RandomHorizontalFlip``'s ``torch.rand(1) >= p`` test in
    ``_RandomApplyTransform.forward``), so under :func:`trainer.data.samples.seeded_for_sample` the result is
    the worker path's crop and the generator ends in the same state. Nothing is allocated: the size is given
    by a zero-stride view.

    Raises:
        ValueError: ``transform`` holds another transform than those two.
    """
    probe = torch.empty((), dtype=torch.uint8).expand(3, height, width)
    top, left, h, w, flip, out_h, out_w = 0, 0, height, width, 0, height, width
    for t in transform.transforms:
        if isinstance(t, v2.RandomResizedCrop):
            p = t.make_params([probe])
            top, left, h, w = p["top"], p["left"], p["height"], p["width"]
            out_h, out_w = t.size
        elif isinstance(t, v2.RandomHorizontalFlip):
            flip = int(not bool(torch.rand(1) >= t.p))
        else:
            raise ValueError(f"draw_train_crop: cannot draw the parameters of {type(t).__name__} without the image")
    return top, left, h, w, flip, out_h, out_w


def apply_train_crop(img: torch.Tensor, crop: CropParams) -> torch.Tensor:
    """Apply a crop drawn by :func:`draw_train_crop`: uint8 (3, H, W) on any device -> uint8
    (3, out_height, out_width) on that device.

    ``torchvision.transforms.v2.functional.resized_crop`` (bilinear, antialias: what :func:`train_transform`'s
    RandomResizedCrop calls), then ``horizontal_flip`` when ``flip``: on the same device and input the output
    is identical (torch.equal) to ``transform(img)`` in the worker.
    """
    from torchvision.transforms.v2 import functional as F

    top, left, h, w, flip, out_h, out_w = (int(v) for v in crop)
    img = F.resized_crop(
        img, top, left, h, w, size=[out_h, out_w], interpolation=v2.InterpolationMode.BILINEAR, antialias=True
    )
    return F.horizontal_flip(img) if flip else img
