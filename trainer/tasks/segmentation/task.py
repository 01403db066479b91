"""The ``segmentation`` task: semantic segmentation of image/mask pairs (trainer/data/formats/segmentation) with
segmentation_models_pytorch or torchvision models, cross-entropy + Dice, and a summed confusion matrix (mIoU)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from trainer.data.transforms import normalize_on_device
from trainer.engine.evaluation import metric_key
from trainer.errors import ConfigError, DataError
from trainer.tasks.base import ExportWrapper, StepOutput, Task, TaskData
from trainer.tasks.segmentation.evaluator import SUMMARY, ConfusionMatrixEvaluator

#: Loss terms logged per epoch as ``train_<name>``.
LOGGED_TERMS = ("loss_ce", "loss_dice")


class SegmentationTask(Task):
    """Per-pixel classification into ``classes``.

    Device batches: ``image`` float32 (B, 3, H, W) ImageNet-normalised, H and W multiples of the model's
    divisor (the collate pads with zeros), ``mask`` int64 (B, H, W) class ids with ``ignore_index`` on void and
    padding, ``size`` int64 (B, 2) the unpadded (h, w), ``n`` = B. Model outputs: logits float (B, C, H, W).
    """

    name = "segmentation"
    target_metric = "miou"
    output_suffixes = ("", "_mask")

    # .. config ............................................................................................
    def check_config(self) -> None:
        """Before any data is read: the architecture and encoder names, the classes, sizes and loss weights.

        Raises:
            ConfigError: the first problem, naming the field.
        """
        from trainer.models.segmentation import SEGMENTATION_MODELS, required_divisor

        cfg = self.cfg
        if cfg.model not in SEGMENTATION_MODELS:
            raise ConfigError(f"model: got {cfg.model!r}; segmentation models: {', '.join(SEGMENTATION_MODELS)}")
        if len(cfg.classes) < 2:
            raise ConfigError(
                f"classes: got {list(cfg.classes)}; declare at least two class names in class-id order "
                "(e.g. [background, roof])"
            )
        keys = [metric_key(c) for c in cfg.classes]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"classes: {list(cfg.classes)} give clashing metric keys {keys}; rename them")
        if not 0 <= cfg.ignore_index <= 65535 or cfg.ignore_index < len(cfg.classes):
            raise ConfigError(
                f"ignore_index: got {cfg.ignore_index}; must be outside the class ids 0..{len(cfg.classes) - 1} "
                "and at most 65535"
            )
        div = required_divisor(cfg.model)
        if cfg.image_size % div:
            raise ConfigError(
                f"image_size: got {cfg.image_size}; {cfg.model} needs a multiple of {div} "
                f"(e.g. {max(div, cfg.image_size // div * div)})"
            )
        if not 0 < cfg.scale_min <= cfg.scale_max:
            raise ConfigError(f"scale_min/scale_max: got {cfg.scale_min}/{cfg.scale_max}; need 0 < min <= max")
        if cfg.ce_weight < 0 or cfg.dice_weight < 0 or cfg.ce_weight + cfg.dice_weight == 0:
            raise ConfigError(f"ce_weight/dice_weight: got {cfg.ce_weight}/{cfg.dice_weight}; both >= 0 and not both 0")
        if cfg.eval_window % div or cfg.eval_window < 0 or not 0 <= cfg.eval_overlap <= 0.9:
            raise ConfigError(
                f"eval_window/eval_overlap: got {cfg.eval_window}/{cfg.eval_overlap}; the window must be 0 or a "
                f"multiple of {div} ({cfg.model}'s stride), the overlap in 0..0.9"
            )
        if not 0 <= cfg.val_fraction < 1:
            raise ConfigError(f"val_fraction: got {cfg.val_fraction}; expected 0 <= val_fraction < 1")
        if cfg.max_samples < 0 or cfg.palette_tolerance < 0 or cfg.epochs_per_dataset < 0 or cfg.tile_window < 0:
            raise ConfigError("max_samples, palette_tolerance, epochs_per_dataset and tile_window must be >= 0")
        self.check_target()

    def metric_directions(self) -> dict[str, str]:
        """``miou``, ``pixel_acc``, ``mean_acc``, ``iou_<class>`` and, with several ``datasets``,
        ``miou_<dataset>`` / ``pixel_acc_<dataset>``: all higher-is-better."""
        names = [metric_key(n) for n in self.source_names()]
        per = [f"{m}_{n}" for n in (names if len(names) > 1 else []) for m in ("miou", "pixel_acc")]
        return {k: "max" for k in (*SUMMARY, *(f"iou_{metric_key(c)}" for c in self.cfg.classes), *per)}

    def source_names(self) -> list[str]:
        """Names of the ``datasets`` entries, in order (empty list: one dataset from the flat fields)."""
        return [str(d.get("name", "")) for d in self.cfg.datasets if isinstance(d, dict)]

    # .. data and model ....................................................................................
    def build_data(self) -> TaskData:
        """Scan every source's splits (pairing rule, headers, sizes: trainer/data/formats/segmentation), then the
        datasets with the joint transforms; several sources are drawn together by weight and tagged for the
        per-dataset metrics.

        Label space in checkpoints: ``{"classes": names, "ignore_index": int}``.

        Raises:
            DataError: unusable folders or pairs, a bad palette, class map or ``datasets`` entry.
        """
        from trainer.data.formats.segmentation import (
            EvalTransform,
            SegmentationCollate,
            SegmentationDataset,
            TrainTransform,
        )
        from trainer.data.formats.segmentation.pairs import check_val_masks, decode_mask
        from trainer.data.formats.segmentation.sources import MultiSourceDataset, build_sources
        from trainer.models.segmentation import required_divisor

        cfg = self.cfg
        if not Path(cfg.data_dir).is_dir():
            raise DataError(f"data_dir: {cfg.data_dir} is not a folder (expected {cfg.seg_images} and {cfg.seg_masks})")
        sources = build_sources(cfg)
        n = len(cfg.classes)
        train_tf = TrainTransform(cfg.image_size, cfg.scale_min, cfg.scale_max, cfg.hflip_prob, cfg.ignore_index)
        eval_tf = EvalTransform(cfg.image_size if cfg.eval_resize else 0)
        parts: dict[str, list] = {"train": [], "val": []}
        report = [f"data: {len(sources)} dataset(s), {n} shared classes ({', '.join(cfg.classes)})"]
        left_out = 0
        for src in sources:
            src.splits["val"], lines, n_bad = check_val_masks(
                src.splits["val"],
                partial(
                    decode_mask,
                    num_classes=len(src.classes),
                    ignore_index=cfg.ignore_index,
                    palette=src.palette,
                    unknown=src.unknown_colour,
                    tolerance=src.palette_tolerance,
                ),
                cfg.ignore_index,
                cfg.max_bad_fraction,
            )
            src.splits["val"].report += lines
            left_out += n_bad
            for split, tf in (("train", train_tf), ("val", eval_tf)):
                parts[split].append(
                    SegmentationDataset(
                        src.splits[split],
                        tf,
                        len(src.classes),
                        ignore_index=cfg.ignore_index,
                        palette=src.palette,
                        unknown_colour=src.unknown_colour,
                        palette_tolerance=src.palette_tolerance,
                        lut=src.lut,
                        window=cfg.tile_window if split == "train" else 0,
                        seed=cfg.seed,
                        replace_bad=split == "train",
                    )
                )
            report.append(
                f"data: {src.name}: {src.rule.root}: {len(src.splits['train'])} train and {len(src.splits['val'])} "
                f"val pairs, weight {src.weight:g}, masks as {'palette colours' if src.palette is not None else 'ids'}"
            )
            report += src.splits["train"].report + src.splits["val"].report
        train = MultiSourceDataset(parts["train"], [s.weight for s in sources], cfg.epochs_per_dataset)
        val = MultiSourceDataset(parts["val"])
        collate = SegmentationCollate(required_divisor(cfg.model), cfg.ignore_index)
        space = {"classes": list(cfg.classes), "ignore_index": cfg.ignore_index}
        return TaskData(train, val, collate, n, report, label_space=space, val_left_out=left_out)

    def build_model(self, num_outputs: int) -> nn.Module:
        """The configured architecture (``model``) with ``encoder`` / ``encoder_weights``, ``num_outputs`` classes;
        the loss is built beside it.

        Raises:
            ConfigError: unknown architecture or encoder, unusable ``encoder_weights``.
        """
        from trainer.models.segmentation import build_segmentation_model
        from trainer.tasks.segmentation.loss import SegmentationLoss

        cfg = self.cfg
        self.loss = SegmentationLoss(num_outputs, cfg.ignore_index, cfg.ce_weight, cfg.dice_weight)
        return build_segmentation_model(cfg.model, num_outputs, cfg.encoder, cfg.encoder_weights)

    # .. one step ..........................................................................................
    def _device_batch(self, batch: dict) -> dict:
        dev = self.dist.device
        return {
            "image": normalize_on_device(batch["image"], dev, self.cfg.channels_last),
            "mask": batch["mask"].to(dev, non_blocking=True),
            "size": batch["size"],
            "source": batch["source"],
            "n": int(batch["image"].shape[0]),
        }

    def train_batch(self, batch: dict) -> dict:
        """The collated batch on the device (augmentation ran in the loader workers)."""
        return self._device_batch(batch)

    def eval_batch(self, batch: dict) -> dict:
        return self._device_batch(batch)

    def model_step(self, model: nn.Module, batch: dict) -> StepOutput:
        """Logits of the batch, cross-entropy + Dice on the non-ignored pixels (float32), each term logged."""
        logits = model(batch["image"])
        losses = self.loss(logits, batch["mask"])
        return StepOutput(
            loss=losses["loss"], outputs=logits, n=batch["n"], terms={k: losses[k].detach() for k in LOGGED_TERMS}
        )

    def predict(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """Predicted class ids int64 (B, H, W): argmax of the logits, from sliding windows of ``eval_window``
        (:func:`~trainer.models.segmentation.sliding_window_logits`) when the image is larger than one.

        With ``batch["own_size"]`` (``predict``) each image runs at its own size padded to the model's stride, in
        groups of one size (:func:`~trainer.tasks.prediction.same_size_groups`), so its mask is that of a batch of 1
        whatever else the batch holds (batch padding changed the image's border features and the sliding windows'
        positions); pixels beyond an image's own padded size are 0. Cost: one forward per distinct size."""
        from trainer.models.segmentation import required_divisor, sliding_window_logits

        def classes(images: torch.Tensor) -> torch.Tensor:
            if self.cfg.eval_window:
                return sliding_window_logits(model, images, self.cfg.eval_window, self.cfg.eval_overlap).argmax(1)
            return model(images).argmax(1)

        if not batch.get("own_size"):
            return classes(batch["image"])
        from trainer.tasks.prediction import same_size_groups

        images, m = batch["image"], required_divisor(self.cfg.model)
        out = torch.zeros((images.shape[0], *images.shape[-2:]), dtype=torch.int64, device=images.device)
        for group in same_size_groups(batch["size"].tolist()):
            h, w = (-(-int(v) // m) * m for v in batch["size"][group[0]])  # its own size, padded as in a batch of 1
            idx = torch.tensor(group, device=images.device)
            out[idx, :h, :w] = classes(images[idx, :, :h, :w])
        return out

    @classmethod
    def evaluator_class(cls):
        return ConfusionMatrixEvaluator

    def evaluator(self) -> ConfusionMatrixEvaluator:
        """Confusion matrix over ``classes``, summed across ranks (mIoU, pixel accuracy, per-class IoU)."""
        return ConfusionMatrixEvaluator(
            len(self.cfg.classes),
            list(self.cfg.classes),
            self.dist.device,
            self.cfg.ignore_index,
            self.source_names(),
        )

    # .. planning ..........................................................................................
    def example_batch(
        self, batch_size: int, *, image_size: Optional[int] = None, num_outputs: int = 2, train: bool = True
    ) -> dict:
        """A device batch as :meth:`train_batch` returns it: images (B, 3, S, S) at ``image_size`` (default the
        crop size), random masks over ``num_outputs`` classes."""
        size = image_size or self.cfg.image_size
        dev = self.dist.device
        u8 = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, device=dev)
        return {
            "image": normalize_on_device(u8, dev, self.cfg.channels_last),
            "mask": torch.randint(0, num_outputs, (batch_size, size, size), device=dev),
            "size": torch.tensor([[size, size]] * batch_size),
            "source": torch.zeros(batch_size, dtype=torch.int64),
            "n": batch_size,
        }

    # .. prediction (python -m trainer predict) .............................................................
    def predict_inputs(self, paths: list[str], *, first_index: int = 0) -> dict:
        """Decode, evaluation resize (shorter side ``image_size``), pad to the model's stride and collate, then
        :meth:`eval_batch`; plus ``"paths"``, ``"bad"`` and ``"originals"`` (decoded uint8 (3, H, W))."""
        from torchvision import tv_tensors

        from trainer.data.formats.segmentation import EvalTransform, SegmentationCollate
        from trainer.models.segmentation import required_divisor
        from trainer.tasks.prediction import read_images

        kept, originals, bad = read_images(paths)
        transform = EvalTransform(self.cfg.image_size if self.cfg.eval_resize else 0)
        items = []
        for img in originals:
            empty = torch.full(img.shape[1:], self.cfg.ignore_index, dtype=torch.int64)
            image, mask = transform(tv_tensors.Image(img), tv_tensors.Mask(empty))
            items.append((image, mask, ()))
        batch = self.eval_batch(SegmentationCollate(required_divisor(self.cfg.model), self.cfg.ignore_index)(items))
        batch.update(paths=kept, bad=bad, originals=originals, own_size=True)
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
        """Per input: the predicted class ids at the file's resolution (nearest), written as a class-index PNG
        (``<name>_mask.png``, uint8 ids) and as an overlay on the image (``torchvision.utils.draw_segmentation_masks``,
        alpha 0.5, the config's palette colours when it has one); a record ``{"file", "mask", "overlay",
        "pixels": {class: pixel count}}``. ``score_threshold`` does not apply (no scores per pixel)."""
        import numpy as np
        from PIL import Image
        from torch.nn import functional as F
        from torchvision.utils import draw_segmentation_masks

        from trainer.tasks.prediction import color_of, save_png

        names = list(label_space.get("classes") or self.cfg.classes)
        colours = [f"#{''.join(f'{int(v):02x}' for v in c.split(','))}" for c in self.cfg.palette] or [
            color_of(i) for i in range(len(names))
        ]
        records = []
        for i, path in enumerate(paths):
            img = batch["originals"][i]
            h, w = (int(v) for v in batch["size"][i])
            pred = outputs[i, :h, :w].float()[None, None]
            pred = F.interpolate(pred, size=tuple(img.shape[-2:]), mode="nearest")[0, 0].long().cpu()
            stem = Path(out_names[i] if out_names else Path(path).name).stem
            mask_path, overlay_path = Path(out_dir) / f"{stem}_mask.png", Path(out_dir) / f"{stem}.png"
            Image.fromarray(pred.numpy().astype(np.uint8)).save(mask_path)
            onehot = torch.stack([pred == c for c in range(len(names))])
            save_png(draw_segmentation_masks(img, onehot, alpha=0.5, colors=colours[: len(names)]), overlay_path)
            counts = torch.bincount(pred.reshape(-1), minlength=len(names)).tolist()
            records.append(
                {
                    "file": Path(path).name,
                    "mask": mask_path.name,
                    "overlay": overlay_path.name,
                    "pixels": {n: int(c) for n, c in zip(names, counts)},
                }
            )
        return records

    # .. export (python -m trainer export) ..................................................................
    export_output_names = ("logits", "mask")
    export_dynamic_axes = ("batch", "height", "width")
    #: Largest exported height/width (pixels): the graph takes any multiple of the model's divisor up to this.
    EXPORT_MAX_SIDE = 8192

    def export_dynamic_shapes(self) -> tuple[dict, ...]:
        """Batch, height and width dynamic: H and W any multiple of the model's side divisor
        (:func:`~trainer.models.segmentation.required_divisor`, 32 for a U-Net) up to :data:`EXPORT_MAX_SIDE`, the
        sizes the card's preprocessing (resize the shorter side, pad H and W to the divisor) gives."""
        from trainer.models.segmentation import required_divisor

        d = required_divisor(self.cfg.model)
        batch = torch.export.Dim("batch", min=1, max=1024)
        height = torch.export.Dim("height", min=1, max=self.EXPORT_MAX_SIDE // d)
        width = torch.export.Dim("width", min=1, max=self.EXPORT_MAX_SIDE // d)
        return ({0: batch, 2: d * height, 3: d * width},)

    def export_module(self, model: nn.Module) -> nn.Module:
        """Normalisation, the segmentation model, then ``logits`` float32 (B, C, H, W) and ``mask`` int64 (B, H, W)
        class ids (their argmax). One forward over the whole input (``predict``'s sliding windows, when
        ``eval_window`` is set, stay outside the graph)."""
        return ExportWrapper(model, argmax_outputs)

    def export_metadata(self, label_space: dict, fmt: str = "onnx") -> dict:
        """The default facts plus the palette (``r,g,b`` per class, when the config has one), ``ignore_index`` and
        the side divisor inputs must be padded to."""
        from trainer.models.segmentation import required_divisor

        cfg = self.cfg
        return {
            **super().export_metadata(label_space, fmt),
            "palette": list(cfg.palette or []),
            "ignore_index": cfg.ignore_index,
            "size_divisor": required_divisor(cfg.model),
            "input_size": f"any H and W that are multiples of {required_divisor(cfg.model)} (trained at "
            f"{cfg.image_size})",
            "preprocess": (f"resize shorter side to {cfg.image_size}" if cfg.eval_resize else "no resize")
            + f", zero-pad H and W to a multiple of {required_divisor(cfg.model)}",
        }

    def export_agreement(self, reference: list, exported: list) -> str:
        """Mask pixel agreement: the share of pixels whose class id (output ``mask``) is the same."""
        same = reference[1] == exported[1]
        return f"mask pixel agreement {100.0 * float(same.mean()):.3f} % ({int(same.sum())}/{same.size})"

    def backbone_license(self) -> str:
        """segmentation_models_pytorch encoders: the weights' license is their source's (smp's encoder table)."""
        return (
            f"model code segmentation_models_pytorch (MIT) / torchvision (BSD-3-Clause); encoder "
            f"{self.cfg.encoder!r} weights ({self.cfg.encoder_weights or 'none'}): per the source smp lists for that "
            "encoder (torchvision ImageNet weights for ResNets; others unknown here)"
        )


def argmax_outputs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, logits.argmax(1))``: a segmentation model's exported outputs (mask int64 (B, H, W))."""
    return logits, logits.argmax(1)
