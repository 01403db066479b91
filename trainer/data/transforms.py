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


@functools.lru_cache(maxsize=8)
def _mean_inv_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255.0
    inv_std = 1.0 / (torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255.0)
    return mean, inv_std


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
