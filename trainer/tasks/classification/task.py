"""Image classification: ImageFolder data, any torchvision classification model, cross-entropy with label
smoothing, MixUp/CutMix (torchvision.transforms.v2), top-1/top-5 accuracy."""

from __future__ import annotations

import difflib
import functools
from typing import Optional

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch._guards import active_fake_mode
from torchvision.transforms import v2

from trainer.config import BUILTIN_DIGITS, ConfigError
from trainer.data.formats.device_jpeg import collate_encoded, decode_on_device
from trainer.data.formats.digits import ensure_digits
from trainer.data.formats.imagefolder import ImageFolderDataset, check_same_classes, check_split, scan_split
from trainer.data.samples import collate_skip_bad
from trainer.data.transforms import normalize_on_device, train_size_for_epoch, train_transform, val_transform
from trainer.engine.evaluation import SumEvaluator
from trainer.tasks.base import ExportWrapper, StepOutput, Task, TaskData


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
        raise ConfigError(
            f"model: unknown classification model {name!r}"
            + (f"; did you mean {', '.join(close)}?" if close else "")
            + " (see torchvision.models.list_models(module=torchvision.models))"
        )
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def check_input_size(name: str, sizes: dict[int, str]) -> None:
    """Check that torchvision model ``name`` accepts square images of each size in ``sizes``.

    ``sizes`` maps a size (pixels) to where it comes from (config fields, for the message). The model is
    built on the meta device and run once on a (1, 3, S, S) meta tensor per size: shapes only, no memory, no
    weights (about 0.3 s for resnet50 or vit_b_16 on one CPU core). Models that cannot be built on the meta
    device (they read tensor values while building, e.g. the RegNets) are not checked.

    Raises:
        ConfigError: unknown model name; or the model rejects a size (fixed-size models such as the ViTs, or
            a size too small for the model's downsampling), naming ``model``, the size's fields and the
            model's own message.
    """
    from trainer.models.meta_check import meta_rejection

    ordered = sorted(sizes)
    rejected = meta_rejection(lambda: build_classifier(name, 10), [(1, 3, size, size) for size in ordered])
    if rejected:
        size, msg = rejected[0][-1], rejected[1]
        raise ConfigError(
            f"model: {name} cannot take {size}x{size} images ({sizes[size]}): {msg}; choose another image_size or model"
        )


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
    """ImageFolder classification. Batches: ``image`` uint8 (B,3,H,W), ``label`` int64 (B,); with
    ``decode_device: cuda`` the encoded batch of :func:`~trainer.data.formats.device_jpeg.collate_encoded`,
    decoded on the device by :meth:`train_batch` / :meth:`eval_batch`.

    Targets in training are int64 class indices, or float32 (B, num_classes) soft labels when MixUp/CutMix
    is on. Eval statistics vector: [loss_sum, top1_correct, top5_correct, count] (float64).
    """

    name = "classification"
    target_metric = "top1"

    @functools.cached_property
    def _mix(self):
        cfg, n = self.cfg, self.num_classes
        cutmix = (
            v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=n) if cfg.cutmix_alpha > 0 and cfg.cutmix_prob > 0 else None
        )
        mixup = v2.MixUp(alpha=cfg.mixup_alpha, num_classes=n) if cfg.mixup_alpha > 0 else None
        if cutmix and mixup:
            return v2.RandomChoice([cutmix, mixup], p=[cfg.cutmix_prob, 1.0 - cfg.cutmix_prob])
        if cutmix:
            return v2.RandomApply([cutmix], p=cfg.cutmix_prob)  # unmixed batches keep int labels
        return mixup

    def check_config(self) -> None:
        """Before the data scan: ``model`` is a torchvision classifier that accepts ``image_size`` and, with
        progressive resizing, every training size (:func:`check_input_size`); ``decode_device: cuda`` only
        with a CUDA training device. Raises :class:`ConfigError`."""
        cfg = self.cfg
        sizes = {cfg.image_size: f"image_size={cfg.image_size}"}
        if cfg.progressive_resize:
            for e in range(cfg.epochs):
                sizes.setdefault(
                    train_size_for_epoch(cfg, e),
                    f"progressive resizing in epoch {e + 1}: "
                    f"progressive_min_size={cfg.progressive_min_size}, image_size={cfg.image_size}",
                )
        check_input_size(cfg.model, sizes)
        if cfg.decode_device == "cuda" and self.dist.device.type != "cuda":
            raise ConfigError(
                f"decode_device: got 'cuda' but the training device is {self.dist.device} (device={cfg.device}, "
                f"torch.cuda.is_available()={torch.cuda.is_available()}); expected cpu, or a run on a CUDA GPU"
            )
        metric, _ = self.check_target()
        if cfg.target_value is not None and metric != "loss" and not 0 < cfg.target_value <= 100:
            raise ConfigError(
                f"target_value: got {cfg.target_value}; {metric} is a percentage: give a value in (0, 100]"
            )

    def build_data(self) -> TaskData:
        """Scan (or open, with FFCV) both splits; check the val files up front and leave bad ones out.

        The label space stored in checkpoints is ``{"classes": [class folder names]}`` (FFCV: the names in
        ``<split>.json``, else ``["0", "1", ...]``).
        """
        cfg = self.cfg
        if cfg.use_ffcv:  # checked .ffcv files, read by FFCV's own loaders (trainer/data/formats/ffcv.py)
            from trainer.data.formats.ffcv import build_loaders, open_splits

            train, val, self.num_classes, report = open_splits(cfg)
            classes = list(train.classes) if train.classes else [str(i) for i in range(self.num_classes)]
            return TaskData(
                train,
                val,
                collate_skip_bad,
                self.num_classes,
                report,
                label_space={"classes": classes},
                loaders=build_loaders,
            )
        root = ensure_digits() if cfg.data_dir == BUILTIN_DIGITS else cfg.data_dir
        train_scan = scan_split(root, cfg.train_split)
        val_scan = scan_split(root, cfg.val_split)
        check_same_classes(train_scan, val_scan)
        self.num_classes = len(train_scan.classes)
        if self.num_classes < 2:
            raise ConfigError(f"data_dir: {root} has {self.num_classes} class; classification needs >= 2")
        report = [
            f"data: {root}",
            f"data: {cfg.train_split}: {train_scan.census()}",
            f"data: {cfg.val_split}: {val_scan.census()}",
        ]
        odd = {ext: n for ext, n in train_scan.formats.items() if ext not in (".jpg", ".jpeg", ".png")}
        if odd:
            report.append(
                f"data: note: non-JPEG/PNG files in {cfg.train_split} are decoded too: "
                + ", ".join(f"{n} {e}" for e, n in odd.items())
            )
        n_val = len(val_scan.samples)
        val_scan, val_report = check_split(val_scan, cfg.max_bad_fraction)  # bad val files: named, left out
        report += val_report
        dd = cfg.decode_device
        train = ImageFolderDataset(train_scan, _TrainTransformForEpoch(cfg), seed=cfg.seed, decode_device=dd)
        val = ImageFolderDataset(
            val_scan, _ValTransformForEpoch(cfg), seed=cfg.seed, replace_bad=False, decode_device=dd
        )
        report.append(
            "data: decode: "
            + (
                f"JPEGs on {self.dist.device} (nvJPEG batches; workers read bytes and draw crops; "
                "other formats, CMYK and truncated JPEGs decoded in the workers)"
                if dd == "cuda"
                else "in the loader workers (torchvision.io, libjpeg-turbo)"
            )
        )
        return TaskData(
            train,
            val,
            collate_encoded if dd == "cuda" else collate_skip_bad,
            self.num_classes,
            report,
            label_space={"classes": list(train_scan.classes)},
            val_left_out=n_val - len(val_scan.samples),
        )

    def build_model(self, num_outputs: int) -> nn.Module:
        """torchvision's ``model`` for ``num_outputs`` classes; with ``weights``, filled from them
        (:func:`trainer.models.pretrained.load_pretrained`; rank 0 prints its report). Not on the meta device or
        under fake tensors (planning: shapes only). Raises ConfigError: unknown model, unusable ``weights``."""
        model = build_classifier(self.cfg.model, num_outputs)
        if self.cfg.weights and not next(model.parameters()).is_meta and active_fake_mode() is None:
            from trainer.models.pretrained import load_pretrained

            line = load_pretrained(model, self.cfg.model, self.cfg.weights, num_outputs)
            if self.dist.rank == 0:
                print(line, flush=True)
        return model

    def epoch_fields(self, epoch: int) -> dict:
        """``image_size``: the training resolution of epoch ``epoch`` (0-based; progressive resizing aware)."""
        return {"image_size": train_size_for_epoch(self.cfg, epoch)}

    def _images(self, batch: dict, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised float32 images (B,3,H,W) on the device and int64 labels (B,), host or device. An encoded
        batch (``decode_device: cuda``) is decoded and cropped on the device first (evaluation: resize and
        centre crop there); a file no decoder reads is replaced in training, dropped in evaluation."""
        labels = batch["label"]
        if "jpeg" in batch:
            evt = None if train else val_transform(self.cfg.image_size, self.cfg.val_resize_ratio)
            images, labels, _ = decode_on_device(batch, self.dist.device, evt, replace_bad=train)
        else:
            images = batch["image"]
        return normalize_on_device(images, self.dist.device, self.cfg.channels_last), labels

    def train_batch(self, batch: dict) -> dict:
        """``{"image": float32 (B,3,H,W) normalised, "label": int64 (B,) or float32 (B, classes) after
        MixUp/CutMix, "n": B}`` on the device."""
        x, y = self._images(batch, train=True)
        y = y.to(self.dist.device, non_blocking=True)
        if self._mix is not None and x.shape[0] > 1:
            x, y = self._mix(x, y)
            if y.is_floating_point():
                y = y.float()
        return {"image": x, "label": y, "n": x.shape[0]}

    def eval_batch(self, batch: dict) -> dict:
        """``{"image": float32 (B,3,H,W), "label": int64 (B,), "n": B}`` on the device (B may be 0)."""
        x, y = self._images(batch, train=False)
        return {"image": x, "label": y.to(self.dist.device, non_blocking=True), "n": y.shape[0]}

    def model_step(self, model: nn.Module, batch: dict) -> StepOutput:
        """Logits (B, classes) and the cross-entropy with ``label_smoothing`` (float32 mean)."""
        out = model(batch["image"])
        loss = F.cross_entropy(out.float(), batch["label"], label_smoothing=self.cfg.label_smoothing)
        return StepOutput(loss=loss, outputs=out, n=batch["n"])

    def predict(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """Logits (B, classes)."""
        return model(batch["image"])

    @classmethod
    def evaluator_class(cls):
        return TopKEvaluator

    def train_statistics(self, out: StepOutput, batch: dict) -> torch.Tensor:
        """float64 [top-1 correct, count] of one micro-batch (soft labels: their argmax)."""
        labels = batch["label"]
        labels = labels.argmax(dim=1) if labels.is_floating_point() else labels
        top1, _ = _correct(out.outputs.detach(), labels)
        return torch.stack(
            [top1.double(), torch.full((), float(labels.shape[0]), dtype=torch.float64, device=labels.device)]
        )

    def train_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        return {"top1": 100.0 * sums[0].item() / max(sums[1].item(), 1.0)}

    def example_batch(
        self,
        batch_size: int,
        *,
        image_size: Optional[int] = None,
        num_outputs: int = 1000,
        train: bool = True,
        mixed_targets: Optional[bool] = None,
    ) -> dict:
        """A device batch as :meth:`train_batch` returns it, without a loader: ``image`` float32
        (batch_size, 3, S, S) in the normalised range (channels_last when configured), ``label`` int64
        (batch_size,) class indices, or float32 (batch_size, num_outputs) soft labels when MixUp/CutMix is on
        (``mixed_targets`` None: decided by the config; always hard labels for ``train=False``)."""
        cfg, dev = self.cfg, self.dist.device
        size = image_size or cfg.image_size
        if mixed_targets is None:
            mixed_targets = train and (cfg.mixup_alpha > 0 or (cfg.cutmix_prob > 0 and cfg.cutmix_alpha > 0))
        u8 = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, device=dev)
        if cfg.channels_last:
            u8 = u8.contiguous(memory_format=torch.channels_last)
        x = u8.float().sub_(127.5).div_(64.0)
        if mixed_targets:
            y = torch.softmax(torch.randn(batch_size, num_outputs, device=dev), dim=1)
        else:
            y = torch.randint(0, num_outputs, (batch_size,), device=dev)
        return {"image": x, "label": y, "n": batch_size}

    # .. prediction (python -m trainer predict) .............................................................
    def predict_inputs(self, paths: list[str], *, first_index: int = 0) -> dict:
        """Decode, evaluation transform (resize + centre crop at ``image_size``), :meth:`eval_batch`; plus
        ``"paths"``, ``"bad"`` and ``"originals"`` (the decoded uint8 (3, H, W) images, drawn on)."""
        from trainer.tasks.prediction import read_images

        transform = val_transform(self.cfg.image_size, self.cfg.val_resize_ratio)
        kept, originals, bad = read_images(paths)
        batch = self.eval_batch(collate_skip_bad([(transform(img), 0, ()) for img in originals]))
        batch.update(paths=kept, bad=bad, originals=originals)
        return batch

    def render_predictions(
        self,
        paths: list[str],
        batch: dict,
        outputs: torch.Tensor,
        label_space: dict,
        out_dir: str,
        score_threshold: float,
        *,
        out_names: Optional[list[str]] = None,
    ) -> list[dict]:
        """Records ``{"file", "top5": [{"label": class name, "score": softmax probability}, ...]}`` (top-k for
        fewer than 5 classes); each input drawn with a frame captioned with the top-1 class and its score.
        ``score_threshold`` does not apply (every image gets its top 5)."""
        from trainer.tasks.prediction import render_top_k

        return render_top_k(paths, batch["originals"], outputs, label_space, out_dir, out_names)

    # .. export (python -m trainer export) ..................................................................
    export_output_names = ("logits", "probs")

    def export_module(self, model: nn.Module) -> nn.Module:
        """Normalisation, the classifier, then ``logits`` float32 (B, C) and their softmax ``probs`` (B, C)."""
        return ExportWrapper(model, softmax_outputs)

    def export_metadata(self, label_space: dict, fmt: str = "onnx") -> dict:
        """The default facts plus the evaluation resize (``val_resize_ratio``) and ``top_k`` 5 (what ``predict``
        reports per image)."""
        return {
            **super().export_metadata(label_space, fmt),
            "preprocess": f"resize shorter side to image_size / {self.cfg.val_resize_ratio:g}, centre crop image_size",
            "top_k": 5,
        }


def softmax_outputs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, softmax(logits))`` float32 (B, C): a classifier's exported outputs."""
    return logits, logits.float().softmax(dim=-1)


def _correct(outputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 correct, top-5 correct) counts as 0-d int64 tensors; top-5 is top-k for fewer than 5 classes."""
    k = min(5, outputs.shape[1])
    topk = outputs.topk(k, dim=1).indices
    hit = topk.eq(labels.view(-1, 1))
    return hit[:, :1].sum(), hit.any(dim=1).sum()


class TopKEvaluator(SumEvaluator):
    """Validation loss (mean cross-entropy, no smoothing), top-1 and top-5 accuracy (%), summed over ranks.

    Statistics vector (float64): [loss_sum, top1_correct, top5_correct, count].
    """

    size = 4
    directions = {"loss": "min", "top1": "max", "top5": "max"}

    def statistics(self, outputs: torch.Tensor, batch: dict) -> torch.Tensor:
        labels = batch["label"]
        loss_sum = F.cross_entropy(outputs.float(), labels, reduction="sum")
        top1, top5 = _correct(outputs, labels)
        n = torch.full((), float(labels.shape[0]), dtype=torch.float64, device=outputs.device)
        return torch.stack([loss_sum.double(), top1.double(), top5.double(), n])

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        loss_sum, top1, top5, n = sums.tolist()
        n = max(n, 1.0)
        return {"loss": loss_sum / n, "top1": 100.0 * top1 / n, "top5": 100.0 * top5 / n}
