"""Image classification: ImageFolder data, any torchvision classification model, cross-entropy with label
smoothing, MixUp/CutMix (torchvision.transforms.v2), top-1/top-5 accuracy."""

from __future__ import annotations

import difflib
import functools

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.transforms import v2

from trainer.config import BUILTIN_DIGITS, ConfigError
from trainer.data.digits import ensure_digits
from trainer.data.imagefolder import ImageFolderDataset, check_same_classes, collate_skip_bad, scan_split
from trainer.data.transforms import normalize_on_device, train_size_for_epoch, train_transform, val_transform
from trainer.tasks.base import Task, TaskData


def classification_models() -> list[str]:
    """Names accepted by ``model``: torchvision's classification builders (``torchvision.models``)."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


def build_classifier(name: str, num_classes: int) -> nn.Module:
    """``torchvision.models.get_model(name, weights=None, num_classes=num_classes)``.

    Raises:
        ConfigError: ``name`` is not a torchvision classification model (closest names suggested).
    """
    names = classification_models()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=4)
        raise ConfigError(f"model: unknown classification model {name!r}"
                          + (f"; did you mean {', '.join(close)}?" if close else "")
                          + " (see torchvision.models.list_models(module=torchvision.models))")
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


class _TrainTransformForEpoch:
    """Picklable ``epoch -> transform`` for the loader workers (progressive resize aware)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, epoch: int):
        return train_transform(train_size_for_epoch(self.cfg, epoch), self.cfg.crop_scale_min, self.cfg.hflip_prob)


class _ValTransformForEpoch:
    def __init__(self, cfg):
        self.size, self.ratio = cfg.image_size, cfg.val_resize_ratio

    def __call__(self, epoch: int):
        return val_transform(self.size, self.ratio)


class ClassificationTask(Task):
    """ImageFolder classification. Batches: ``image`` uint8 (B,3,H,W), ``label`` int64 (B,).

    Targets in training are int64 class indices, or float32 (B, num_classes) soft labels when MixUp/CutMix
    is on. Eval statistics vector: [loss_sum, top1_correct, top5_correct, count] (float64).
    """

    name = "classification"
    primary_metric = "top1"
    eval_stat_size = 4

    @functools.cached_property
    def _mix(self):
        cfg, n = self.cfg, self.num_classes
        cutmix = v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=n) if cfg.cutmix_alpha > 0 and cfg.cutmix_prob > 0 else None
        mixup = v2.MixUp(alpha=cfg.mixup_alpha, num_classes=n) if cfg.mixup_alpha > 0 else None
        if cutmix and mixup:
            return v2.RandomChoice([cutmix, mixup], p=[cfg.cutmix_prob, 1.0 - cfg.cutmix_prob])
        if cutmix:
            return v2.RandomApply([cutmix], p=cfg.cutmix_prob)  # unmixed batches keep int labels
        return mixup

    def build_data(self) -> TaskData:
        cfg = self.cfg
        if cfg.use_ffcv:  # checked .ffcv files; the loop builds FFCV's loaders (trainer/data/ffcv.py)
            from trainer.data.ffcv import open_splits

            train, val, self.num_classes, report = open_splits(cfg)
            return TaskData(train, val, collate_skip_bad, self.num_classes, report)
        root = ensure_digits() if cfg.data_dir == BUILTIN_DIGITS else cfg.data_dir
        train_scan = scan_split(root, cfg.train_split)
        val_scan = scan_split(root, cfg.val_split)
        check_same_classes(train_scan, val_scan)
        self.num_classes = len(train_scan.classes)
        if self.num_classes < 2:
            raise ConfigError(f"data_dir: {root} has {self.num_classes} class; classification needs >= 2")
        report = [f"data: {root}",
                  f"data: {cfg.train_split}: {train_scan.census()}",
                  f"data: {cfg.val_split}: {val_scan.census()}"]
        odd = {ext: n for ext, n in train_scan.formats.items() if ext not in (".jpg", ".jpeg", ".png")}
        if odd:
            report.append(f"data: note: non-JPEG/PNG files in {cfg.train_split} are decoded too: "
                          + ", ".join(f"{n} {e}" for e, n in odd.items()))
        train = ImageFolderDataset(train_scan, _TrainTransformForEpoch(cfg), seed=cfg.seed)
        val = ImageFolderDataset(val_scan, _ValTransformForEpoch(cfg), seed=cfg.seed, replace_bad=False)
        return TaskData(train, val, collate_skip_bad, self.num_classes, report)

    def build_model(self, num_outputs: int) -> nn.Module:
        return build_classifier(self.cfg.model, num_outputs)

    def _images(self, batch: dict) -> torch.Tensor:
        return normalize_on_device(batch["image"], self.dist.device, self.cfg.channels_last)

    def train_inputs(self, batch: dict):
        x = self._images(batch)
        y = batch["label"].to(self.dist.device, non_blocking=True)
        if self._mix is not None and x.shape[0] > 1:
            x, y = self._mix(x, y)
            if y.is_floating_point():
                y = y.float()
        return x, y, x.shape[0]

    def eval_inputs(self, batch: dict):
        return self._images(batch), batch["label"].to(self.dist.device, non_blocking=True), batch["label"].shape[0]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets, label_smoothing=self.cfg.label_smoothing)

    @staticmethod
    def _correct(outputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = min(5, outputs.shape[1])
        topk = outputs.topk(k, dim=1).indices
        hit = topk.eq(labels.view(-1, 1))
        return hit[:, :1].sum(), hit.any(dim=1).sum()

    def train_sums(self, outputs, targets):
        labels = targets.argmax(dim=1) if targets.is_floating_point() else targets
        top1, _ = self._correct(outputs.detach(), labels)
        return torch.stack([top1.double(), torch.tensor(float(labels.shape[0]), dtype=torch.float64,
                                                         device=outputs.device)])

    def train_metrics(self, sums):
        return {"top1": 100.0 * sums[0].item() / max(sums[1].item(), 1.0)}

    def eval_sums(self, outputs, targets):
        loss_sum = F.cross_entropy(outputs.float(), targets, reduction="sum")
        top1, top5 = self._correct(outputs, targets)
        n = torch.tensor(float(targets.shape[0]), dtype=torch.float64, device=outputs.device)
        return torch.stack([loss_sum.double(), top1.double(), top5.double(), n])

    def eval_metrics(self, sums):
        loss_sum, top1, top5, n = sums.tolist()
        n = max(n, 1.0)
        return {"loss": loss_sum / n, "top1": 100.0 * top1 / n, "top5": 100.0 * top5 / n}
