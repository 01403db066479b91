"""The serving half of the detection task: ``python -m trainer predict`` (decode, evaluation resize, pad and
collate files; COCO-results records and drawn boxes) and ``python -m trainer export`` (DINO as a graph with
its post-processing: :mod:`trainer.tasks.detection.export`). :class:`DetectionServing` is
mixed into :class:`~trainer.tasks.detection.task.DetectionTask`, which holds the training and evaluation half."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn


class DetectionServing:
    """:class:`~trainer.tasks.base.Task`'s prediction and export hooks for DINO. Expects the task's ``cfg``
    (eval_size, max_size, pad_to_multiple, pad_value, num_select, val_split, train_split), ``_device_batch`` and
    ``split_paths``; ``export_metadata`` extends the next class's in the MRO (the base Task's)."""

    # .. prediction (python -m trainer predict) .............................................................
    def predict_inputs(self, paths: list[str], *, first_index: int = 0) -> dict:
        """Decode, evaluation resize (shorter side ``eval_size``, longer at most ``max_size``), pad and collate
        (:func:`~trainer.data.formats.coco_dataset.collate_detection`, no boxes), on the device with ``own_size``:
        :meth:`predict` runs each image at its own size, so its detections do not depend on the batch (``--batch-size``
        changes speed only); ``orig_size`` holds each file's (H, W), so :meth:`predict` gives boxes in its pixels;
        ``image_ids`` = ``first_index + i`` (the input's position). Plus ``"paths"``, ``"bad"`` and ``"originals"`` (decoded uint8 (3, H, W))."""
        from torchvision import tv_tensors

        from trainer.data.formats.coco_dataset import collate_detection, eval_transform
        from trainer.tasks.prediction import read_images

        transform = eval_transform(self.cfg.eval_size, self.cfg.max_size)
        kept, originals, bad = read_images(paths)
        items = []
        for path, img in zip(kept, originals):
            h, w = int(img.shape[-2]), int(img.shape[-1])
            none = {
                "boxes": tv_tensors.BoundingBoxes(torch.zeros((0, 4)), format="XYXY", canvas_size=(h, w)),
                "labels": torch.zeros((0,), dtype=torch.int64),
            }
            image, target = transform(tv_tensors.Image(img), none)
            target.update(image_id=first_index + paths.index(path), orig_size=(h, w))
            items.append((image, target, ()))
        batch = self._device_batch(
            collate_detection(items, self.cfg.pad_to_multiple, pad_value=self.cfg.pad_value), own_size=True
        )
        batch.update(paths=kept, bad=bad, originals=originals)
        return batch

    def render_predictions(
        self,
        paths: list[str],
        batch: dict,
        outputs: list[dict],
        label_space: dict,
        out_dir: str,
        score_threshold: float,
        *,
        out_names: Optional[list[str]] = None,
    ) -> list[dict]:
        """Records in COCO results format, one per detection scoring at least ``score_threshold``:
        ``{"file", "image_id" (the input's position), "category_id" (the annotations' JSON id, in either
        label space: :class:`~trainer.data.formats.coco.LabelMap`), "category",
        "bbox" [x, y, w, h] in pixels of the file (clipped to it), "score"}``; each input drawn with those boxes,
        captioned ``"<category> 0.87"``, one colour per category."""
        from trainer.data.formats.coco import LabelMap
        from trainer.tasks.prediction import color_of, draw_labelled_boxes, save_png

        labels_of = LabelMap.from_label_space(label_space)  # either label space: index -> JSON id and name
        records = []
        for i, (path, det) in enumerate(zip(paths, outputs)):
            img = batch["originals"][i]
            h, w = int(img.shape[-2]), int(img.shape[-1])
            keep = det["scores"] >= score_threshold
            scores = det["scores"][keep].float().cpu()
            labels = det["labels"][keep].cpu().tolist()
            boxes = det["boxes"][keep].float().cpu().reshape(-1, 4)
            boxes = torch.stack(
                [boxes[:, 0].clamp(0, w), boxes[:, 1].clamp(0, h), boxes[:, 2].clamp(0, w), boxes[:, 3].clamp(0, h)], 1
            )
            boxes[:, 2:] = torch.maximum(boxes[:, 2:], boxes[:, :2])
            captions = []
            for (x0, y0, x1, y1), label, score in zip(boxes.tolist(), labels, scores.tolist()):
                cid = labels_of.category_id(label)
                name = labels_of.name(label) or str(label)
                captions.append(f"{name} {score:.2f}")
                records.append(
                    {
                        "file": Path(path).name,
                        "image_id": int(batch["image_ids"][i]),
                        "category_id": int(label if cid is None else cid),
                        "category": name,
                        "bbox": [round(x0, 2), round(y0, 2), round(x1 - x0, 2), round(y1 - y0, 2)],
                        "score": round(score, 4),
                    }
                )
            drawn = draw_labelled_boxes(img, boxes, captions, [color_of(label) for label in labels])
            save_png(drawn, Path(out_dir) / (out_names[i] if out_names else f"{Path(path).stem}.png"))
        return records

    # .. export (python -m trainer export) ..................................................................
    export_input_names = ("image", "image_size")
    export_output_names = ("scores", "labels", "boxes")

    def _canvas(self) -> int:
        from trainer.tasks.detection.export import canvas_side

        return canvas_side(max(self.cfg.eval_size, self.cfg.max_size), self.cfg.pad_to_multiple)

    def _smallest_side(self) -> int:
        from trainer.tasks.detection.export import smallest_side

        return smallest_side(self.dino_config().level_strides())

    def export_sample_dirs(self, root: Path) -> list[Path]:
        """The image folders of the validation, then the training split (``coco_images``)."""
        return [self.split_paths(self.cfg.val_split)[1], self.split_paths(self.cfg.train_split)[1]]

    def export_module(self, model: nn.Module) -> nn.Module:
        """:class:`~trainer.tasks.detection.export.DinoExport`: ``(image (B, 3, H, W), image_size (B, 2))`` ->
        ``(scores, labels, boxes)``, the top ``num_select`` detections, boxes normalised xyxy."""
        from trainer.tasks.detection.export import DinoExport

        return DinoExport(model, self.cfg.num_select, self.cfg.pad_value)

    def export_example(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Seeded random pixels on the S x S canvas; image ``i`` occupies the whole canvas (even ``i``) or its top
        three quarters (odd ``i``), so the padding mask is exercised. TorchScript is traced at this size."""
        g = torch.Generator().manual_seed(0)
        s = self._canvas()
        image = torch.randint(0, 256, (batch_size, 3, s, s), generator=g).float()
        sizes = torch.tensor([[s if i % 2 == 0 else 3 * s // 4, s] for i in range(batch_size)], dtype=torch.int64)
        return image, sizes

    export_dynamic_axes = ("batch", "height", "width")

    def export_dynamic_shapes(self) -> tuple[dict, ...]:
        """Batch (1 to 1,024), height and width (:func:`~trainer.tasks.detection.export.smallest_side` to the
        canvas side S) dynamic; ``image_size`` shares the batch axis. The lower bound is torch.export's (it will
        not trace a level 1 wide as the general case); ONNX Runtime runs the graph on smaller sides too, and
        :meth:`export_verification` checks it on the data's own sizes (``tests/test_export.py`` on 53-px sides)."""
        batch = torch.export.Dim("batch", min=1, max=1024)
        low, s = self._smallest_side(), self._canvas()
        height = torch.export.Dim("height", min=low, max=max(low + 1, s))
        width = torch.export.Dim("width", min=low, max=max(low + 1, s))
        return ({0: batch, 2: height, 3: width}, {0: batch})

    def export_inputs(self, batch: dict) -> tuple[torch.Tensor, ...]:
        """The evaluation-resized images of a :meth:`predict_inputs` batch on the S x S canvas, and their sizes
        (TorchScript's fixed input)."""
        from trainer.tasks.base import denormalize
        from trainer.tasks.detection.export import place_on_canvas

        return place_on_canvas(denormalize(batch["image"]), batch["mask"].cpu(), self._canvas())

    def export_verification(self, model: nn.Module, module: nn.Module, batch: dict, fmt: str) -> tuple[list, list, str]:
        """Against ``predict`` itself (:meth:`predict`: each image at its own size, no padding), its boxes divided
        by the original (W, H, W, H). ONNX runs each image alone at its own size, as ``predict`` does, so the two
        give the same detections; TorchScript runs the batch on its fixed S x S canvas, whose padding the model
        sees, and the report shows how far that is from ``predict``."""
        import numpy as np

        from trainer.tasks.base import denormalize

        with torch.no_grad():
            predicted = self.predict(model, batch)
        wh = batch["orig_size"].flip(1).repeat(1, 2).float().cpu()  # (B, 4) W, H, W, H
        reference = [
            np.stack([p["scores"].float().cpu().numpy() for p in predicted]),
            np.stack([p["labels"].cpu().numpy() for p in predicted]),
            np.stack([(p["boxes"].float().cpu() / wh[i]).numpy() for i, p in enumerate(predicted)]),
        ]
        if fmt != "onnx":
            return (
                [self.export_inputs(batch)],
                reference,
                f"; the batch on the {self._canvas()}x{self._canvas()} canvas vs predict",
            )
        image = denormalize(batch["image"])
        runs = [
            (image[i : i + 1, :, :h, :w].contiguous(), torch.tensor([[h, w]], dtype=torch.int64))
            for i, (h, w) in enumerate(batch["sizes"])
        ]
        return runs, reference, "; each image alone at its own size, vs predict"

    def export_agreement(self, reference: list, exported: list) -> str:
        """Detections matched: same label and box IoU >= 0.9 (per image, as sets: tied scores may rank apart)."""
        from trainer.tasks.detection.export import match_detections

        matched, total = match_detections(reference, exported)
        return f"detection agreement {100.0 * matched / max(total, 1):.1f} % ({matched}/{total})"

    def export_metadata(self, label_space: dict, fmt: str = "onnx") -> dict:
        """The default facts plus DINO's serving contract: the input sizes (ONNX: any height and width from the
        smallest side to the canvas side S; TorchScript: the S x S canvas), ``num_select`` (detections kept per
        image), the score threshold ``predict`` applies by default (0.3), boxes normalised xyxy, COCO category ids
        per class (``class_ids``)."""
        from trainer.data.formats.coco import LabelMap

        cfg = self.cfg
        s = self._canvas()
        ids, names = LabelMap.from_label_space(label_space).dense()  # per output column, either label space
        resize = f"resize shorter side to {cfg.eval_size} (longer side at most {cfg.max_size})"
        if fmt == "onnx":
            layout = (
                "image: B,3,H,W RGB float32 pixel values in [0, 255]: one image at its own size (predict's "
                "detections), or a batch padded at the bottom and right to its largest (the padding, set to the "
                f"{cfg.pad_value} padding in the graph, changes scores slightly, as in evaluation); image_size: B,2 "
                "int64 (h, w) of each image"
            )
            size, placed = f"any H and W up to {s} px", "run it at its own size"
        else:
            layout = (
                "image: B,3,S,S RGB float32 pixel values in [0, 255], the resized image at the top-left (the rest is "
                f"set to the {cfg.pad_value} padding in the graph); image_size: B,2 int64 (h, w) of the image on "
                "the canvas"
            )
            size, placed = [s, s], f"place at the top-left of the {s}x{s} canvas"
        return {
            **super().export_metadata(label_space, fmt),
            "classes": names,
            "class_ids": ids,
            "input_layout": layout,
            "input_size": size,
            "dynamic_axes": list(self.export_dynamic_axes) if fmt == "onnx" else ["batch"],
            "preprocess": f"{resize}, {placed}",
            "num_select": cfg.num_select,
            "score_threshold": 0.3,
            "postprocess": "in the graph: sigmoid scores, top num_select over queries x classes (sorted); boxes "
            "(x1, y1, x2, y2) normalised to [0, 1] of the image: multiply by the original (W, H, W, H) for pixels; "
            "keep scores >= score_threshold; labels index classes / class_ids",
        }
