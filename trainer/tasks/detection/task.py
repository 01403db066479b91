"""Object detection: DINO-4scale (trainer/models/dino) on COCO-format data (trainer/data/formats/coco.py, coco_dataset.py), scored
by COCO box mAP gathered across ranks (:mod:`.evaluator`).

The model sees the whole batch: in training the targets go into DINO's forward (contrastive denoising builds its
noised queries from them), and the criterion's terms (final layer, denoising, encoder proposals) are logged as
``train_loss_ce``, ``train_loss_bbox_dn`` ... next to their weighted sum ``train_loss``.

The task's other halves are mixed in: the config checks (:mod:`.settings`), the data (:mod:`.data`: splits,
datasets, canvases) and serving (:mod:`.serving`: predict and export).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from trainer.data.transforms import normalize_on_device
from trainer.errors import ConfigError
from trainer.tasks.base import StepOutput, Task
from trainer.tasks.detection.data import DetectionData
from trainer.tasks.detection.evaluator import CocoEvaluator
from trainer.tasks.detection.serving import DetectionServing
from trainer.tasks.detection.settings import DetectionSettings, compile_unavailable

#: Loss terms logged per step and epoch (weighted, as they enter the total): the last decoder layer, its
#: denoising queries and the encoder proposals. The earlier layers' auxiliary terms enter the total only.
LOGGED_TERMS = (
    "loss_ce",
    "loss_bbox",
    "loss_giou",
    "loss_ce_dn",
    "loss_bbox_dn",
    "loss_giou_dn",
    "loss_ce_interm",
    "loss_bbox_interm",
    "loss_giou_interm",
)


class DetectionTask(DetectionSettings, DetectionData, DetectionServing, Task):
    """COCO-format detection with DINO-4scale.

    Device batches: ``image`` float32 (B, 3, H, W) ImageNet-normalised and zero-padded, ``mask`` bool (B, H, W)
    True on padding, ``targets`` [{"labels" int64 (N,), "boxes" float32 (N, 4) cxcywh in [0, 1]}],
    ``orig_size`` int64 (B, 2), ``image_ids`` [int], ``n`` = B. Outputs for evaluation: per image the top
    ``num_select`` (score, label, xyxy box in pixels of the original image).
    """

    name = "detection"
    target_metric = "map"
    flops_predict_speed = False
    static_input_shapes = False  # multi-scale resize: batches padded to many shapes

    def compile_model(self, model: nn.Module) -> None:
        """``torch.compile`` each encoder and decoder layer of DINO (``compile: true``), not the whole model: the
        backbone and heads stay eager, and so does the host-side code around the layers (contrastive denoising's
        layout, query selection, the matcher), which would break a whole-model graph. Our deformable-attention
        op is one node of these graphs (the custom operator ``trainstack::ms_deform_attn``). The layers of one
        stack share their code, so one compiled graph serves all of them; with ``pad_to_multiple`` the padded
        sizes repeat, so few shapes are compiled.

        Raises:
            ConfigError: torch.compile cannot run here (no Triton for CUDA tensors, no C++ compiler for the CPU).
        """
        reason = compile_unavailable(self.dist.device)
        if reason:
            raise ConfigError(f"compile: {reason}; train without --compile")
        for layer in [*model.transformer.encoder.layers, *model.transformer.decoder.layers]:
            layer.compile()

    def lr_scales(self) -> dict[str, float]:
        """The backbone at ``backbone_lr_scale`` x lr (upstream: lr 1e-4, lr_backbone 1e-5)."""
        return {"backbone.": self.cfg.backbone_lr_scale}

    # .. model and step .....................................................................................
    def build_model(self, num_outputs: int) -> nn.Module:
        """DINO-4scale for ``num_outputs`` classes; the criterion and post-processing are built beside it.

        With ``init_from``, the upstream checkpoint's weights are loaded (trainer/models/dino/weights.py) on every
        rank; rank 0 prints the report (``self.init_report`` keeps it). A resumed run overwrites them with its
        checkpoint's weights afterwards. Not on the meta device (planning builds there: no weights to fill).

        Raises:
            ConfigError: ``init_from`` is unreadable, holds no state_dict or fits another architecture.
        """
        from trainer.models.dino.model import build_dino

        self._build_heads(num_outputs)
        model = build_dino(self.dino_config(), num_outputs)
        if self.cfg.init_from and not next(model.parameters()).is_meta:
            from trainer.models.dino.weights import load_upstream

            rank0 = self.dist.rank == 0
            try:
                self.init_report = load_upstream(
                    model, self.cfg.init_from, log=lambda line: print(line, flush=True) if rank0 else None
                )
            except ValueError as e:
                raise ConfigError(f"init_from: {e}") from None
            r = self.init_report
            if rank0 and r.reinitialised and self.cfg.label_space == "contiguous" and r.checkpoint_classes:
                print(
                    f"init_from: the file's class heads have {r.checkpoint_classes} columns; if they are COCO category "
                    "ids (upstream DINO) and the data uses the same ids, label_space: coco_ids loads them as they are "
                    "(docs/detection.md)",
                    flush=True,
                )
        return model

    def _build_heads(self, num_classes: int) -> None:
        from trainer.models.dino.criterion import DinoCriterion, dino_weight_dict
        from trainer.models.dino.matcher import HungarianMatcher
        from trainer.models.dino.postprocess import PostProcess

        d = self.dino_config()
        matcher = HungarianMatcher(
            d.set_cost_class, d.set_cost_bbox, d.set_cost_giou, d.focal_alpha, solver=self.matcher_solver()
        )
        weights = dino_weight_dict(
            d.dec_layers,
            d.cls_loss_coef,
            d.bbox_loss_coef,
            d.giou_loss_coef,
            d.interm_loss_coef,
            use_dn=d.dn_number > 0,
        )
        self.criterion = DinoCriterion(num_classes, matcher, weights, d.focal_alpha)
        self.postprocess = PostProcess(d.num_select)

    def _device_batch(self, batch: dict, own_size: bool = False) -> dict:
        """The collated ``batch`` on the device: normalised, its padding filled (:func:`~trainer.data.formats.
        coco_dataset.fill_padding`, the collate's ``pad_value``), ``sizes`` int64 (B, 2) each image's (h, w)
        before padding; ``own_size``: :meth:`predict` runs each image at its own size."""
        from trainer.data.formats.coco_dataset import fill_padding

        dev = self.dist.device
        mask = batch["mask"].to(dev, non_blocking=True)
        targets = [
            {"labels": t["labels"].to(dev, non_blocking=True), "boxes": t["boxes"].to(dev, non_blocking=True)}
            for t in batch["targets"]
        ]
        return {
            "image": fill_padding(normalize_on_device(batch["image"], dev, False), mask, batch.get("pad_value")),
            "mask": mask,
            "sizes": [tuple(int(v) for v in t["size"]) for t in batch["targets"]],
            "own_size": own_size,
            "targets": targets,
            "orig_size": torch.stack([torch.as_tensor(t["orig_size"]) for t in batch["targets"]])
            if batch["targets"]
            else torch.empty((0, 2), dtype=torch.int64),
            "image_ids": [int(t["image_id"]) for t in batch["targets"]],
            "n": len(batch["targets"]),
        }

    def train_batch(self, batch: dict) -> dict:
        """The collated batch on the device (augmentation already ran in the loader workers)."""
        return self._device_batch(batch)

    def eval_batch(self, batch: dict) -> dict:
        """The collated batch on the device; with ``eval_protocol: upstream`` each image is predicted at its own
        size without padding (:meth:`predict`)."""
        return self._device_batch(batch, own_size=self.cfg.eval_protocol == "upstream")

    def model_step(self, model: nn.Module, batch: dict) -> StepOutput:
        """DINO's forward with the targets (denoising), then the criterion (float32): the weighted sum and the
        :data:`LOGGED_TERMS` (the criterion is built beside the model by :meth:`build_model`)."""
        if self.cfg.cuda_graphs and model.training:
            out = self._graphed_forward(model, batch)
        else:
            out = model(batch["image"], batch["mask"], batch["targets"])
        total, losses = self.criterion.loss_and_terms(out, batch["targets"])
        return StepOutput(
            loss=total, outputs=out, n=batch["n"], terms={k: losses[k].detach() for k in LOGGED_TERMS if k in losses}
        )

    def _graphed_forward(self, model: nn.Module, batch: dict) -> dict:
        """:meth:`model_step`'s forward with ``cuda_graphs``: denoising's queries eagerly, the dense part from the
        graph of this canvas (:class:`~trainer.models.dino.graphs.GraphedDense`, captured on first sight)."""
        graphs = getattr(self, "_graphs", None)
        if graphs is None or graphs.model is not model:
            from trainer.models.dino.graphs import GraphedDense

            rank0 = self.dist.rank == 0
            graphs = self._graphs = GraphedDense(model, log=lambda line: print(line, flush=True) if rank0 else None)
        label, bbox, attn_mask, dn_meta = model.denoising_queries(batch["targets"])
        return model.pack(graphs(batch["image"], batch["mask"], label, bbox, attn_mask), dn_meta)

    def predict(self, model: nn.Module, batch: dict) -> list[dict]:
        """Top-``num_select`` detections per image in pixels of the original image (PostProcess).

        With ``batch["own_size"]`` (``predict``, and evaluation under ``eval_protocol: upstream``) the images are
        cropped to their own (h, w) and run in groups of one size (:func:`~trainer.tasks.prediction.
        same_size_groups`): no padding reaches the model, so an image's detections are those of a batch of 1
        (upstream DINO's evaluation), whatever else its batch holds, to float noise. Cost: one forward per
        distinct size in the batch (one for a folder of same-size images; B for B sizes)."""
        orig = batch["orig_size"]
        if not batch.get("own_size"):
            out = model(batch["image"], batch["mask"])
            return self.postprocess(out, orig.to(out["pred_boxes"].device))
        from trainer.tasks.prediction import same_size_groups

        results: list = [None] * len(batch["sizes"])
        for group in same_size_groups(batch["sizes"]):
            h, w = batch["sizes"][group[0]]
            idx = torch.tensor(group, device=batch["image"].device)
            out = model(batch["image"][idx, :, :h, :w], batch["mask"][idx, :h, :w])
            for i, det in zip(group, self.postprocess(out, orig[group].to(out["pred_boxes"].device))):
                results[i] = det
        return results

    @classmethod
    def evaluator_class(cls):
        return CocoEvaluator

    def evaluator(self) -> CocoEvaluator:
        val = getattr(self, "val_split", None)
        if val is None:
            return CocoEvaluator()
        ids, names = val.label_map.dense()  # per class index, whichever the label space
        return CocoEvaluator(val.annotations, tuple(ids), tuple(names), tuple(i for i, _, _ in val.left_out))

    # .. planning ...........................................................................................
    def input_size(self, train: bool = True) -> tuple[int, int]:
        """(H, W) of the largest batch: shorter side ``max_scale`` (training) or ``eval_size`` (evaluation), longer
        side ``max_size`` (a landscape image at the resize cap; DINO's recipe gives 800 x 1333), each rounded up to
        ``pad_to_multiple`` as the collate pads it (832 x 1344 at the default 64). With ``canvases`` on: the largest
        canvas; for ``auto``, which is chosen from the data, the largest any data could need: ``max_size`` on both
        sides (1344 x 1344)."""
        setting = self.canvas_setting()
        if setting:
            from trainer.data.formats.canvases import cover_canvas

            return (
                max(setting, key=lambda c: c[0] * c[1])
                if setting != "auto"
                else cover_canvas(self.cfg.max_size, self.cfg.pad_to_multiple)
            )
        short = self.cfg.max_scale if train else self.cfg.eval_size
        m = self.cfg.pad_to_multiple
        return -(-short // m) * m, -(-max(short, self.cfg.max_size) // m) * m

    def example_batch(
        self,
        batch_size: int,
        *,
        image_size: Optional[int] = None,
        num_outputs: int = 1000,
        train: bool = True,
        boxes_per_image: int = 8,
    ) -> dict:
        """A device batch as :meth:`train_batch` returns it: images (B, 3, S, L), by default :meth:`input_size`
        (the largest landscape image, e.g. 800 x 1333); ``image_size`` sets S and L in the same ratio. No padding,
        ``boxes_per_image`` random boxes per image (COCO averages ~7) with labels < ``num_outputs``."""
        dev = self.dist.device
        short, long = self.input_size(train)
        if image_size:
            short, long = image_size, max(image_size, round(image_size * long / short))
        g = torch.Generator().manual_seed(0)
        targets = []
        for _ in range(batch_size):
            cxcy = torch.rand(boxes_per_image, 2, generator=g) * 0.6 + 0.2
            wh = torch.rand(boxes_per_image, 2, generator=g) * 0.3 + 0.05
            targets.append(
                {
                    "labels": torch.randint(0, num_outputs, (boxes_per_image,), generator=g).to(dev),
                    "boxes": torch.cat([cxcy, wh], 1).to(dev),
                }
            )
        return {
            "image": torch.randn(batch_size, 3, short, long, device=dev),
            "mask": torch.zeros(batch_size, short, long, dtype=torch.bool, device=dev),
            "targets": targets,
            "orig_size": torch.tensor([[short, long]] * batch_size),
            "image_ids": list(range(batch_size)),
            "n": batch_size,
        }
