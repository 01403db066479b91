"""COCO box mAP of a detection run, gathered across ranks (faster-coco-eval's COCOeval on the split's own JSON).

faster-coco-eval (https://github.com/MiXaiLL76/faster_coco_eval) is pycocotools' COCO API with ``evaluate`` and
``accumulate`` in C++: the same matching, area ranges, 101-point interpolation and ``stats``, several times
faster on val-size predictions (docs/benchmarks.md, "Scale"); tests/tasks/test_detection_evaluator.py checks that
its numbers equal pycocotools' on the same predictions.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from trainer.engine.evaluation import GatherEvaluator, metric_key

#: COCOeval ``stats`` indices (pycocotools ``COCOeval.summarize``) -> our metric names; values in % (x 100).
STATS = {"map": 0, "map_50": 1, "map_75": 2, "map_small": 3, "map_medium": 4, "map_large": 5, "mar_100": 8}


class CocoEvaluator(GatherEvaluator):
    """Box mAP@[.5:.95], mAP@0.5, mAP@0.75, small/medium/large, AR@100 (``mar_100``: recall at 100 detections
    per image, averaged over IoUs .5:.95 and categories) and per-class AP (``ap_<name>``), in %. A value COCOeval
    leaves undefined (-1: no ground truth in that area range or category) is NaN, printed ``-``, never 0.

    Each rank keeps one record per evaluated image: ``(image_id, detections)`` with detections as COCO results
    ``[x, y, w, h, score, category_id]`` (pixels of the original image, the JSON's category ids); :meth:`compute`
    gathers every rank's records and runs faster-coco-eval's ``COCOeval_faster`` (pycocotools' algorithm in C++;
    iouType "bbox", its standard 100 detections
    per image, area ranges and 101-point interpolation; Lin et al. 2014 and https://cocodataset.org/#detection-eval)
    on the images evaluated plus the split's ``left_out`` images, against the split's annotation JSON (crowd boxes
    are ignore regions there). An image the reader dropped (a zero-area box, a missing file) keeps its ground truth
    as missed detections, so dropping images cannot raise mAP; ``images`` counts the evaluated images and
    ``images_dropped`` the others. An empty set of detections scores 0.

    Args:
        annotations: the split's COCO JSON (the ground truth, as written; ``area`` is filled from the box when
            missing; annotation ids are renumbered 1..N, since COCOeval (pycocotools' too) takes id 0 for
            "unmatched" and would count a detection of that box as a false positive).
        label_to_category_id: class index -> JSON category id (either label space:
            :meth:`~trainer.data.formats.coco.LabelMap.dense`).
        categories: category names by class index (for the per-class keys; ``""`` for an undeclared index).
        left_out: JSON ids of the split's images the reader left out (``CocoSplit.left_out``).
    """

    directions = {k: "max" for k in STATS}

    def __init__(
        self,
        annotations: Optional[Path] = None,
        label_to_category_id: tuple = (),
        categories: tuple = (),
        left_out: tuple = (),
    ):
        super().__init__()
        self.left_out = sorted({int(i) for i in left_out})
        self.annotations = annotations
        self.label_to_category_id = list(label_to_category_id)
        self.categories = list(categories)
        self._gt = None

    def records(self, outputs: list[dict], batch: dict) -> list:
        """``outputs``: per image {"scores" (K,), "labels" (K,) int64, "boxes" (K, 4) xyxy pixels of the original
        image} (the post-processed predictions); ``batch["image_ids"]``: their JSON ids."""
        out = []
        for det, image_id in zip(outputs, batch["image_ids"]):
            boxes = det["boxes"].float().cpu().numpy()
            scores = det["scores"].float().cpu().numpy()
            labels = det["labels"].cpu().numpy()
            rows = [
                [
                    float(b[0]),
                    float(b[1]),
                    float(b[2] - b[0]),
                    float(b[3] - b[1]),
                    float(s),
                    int(self.label_to_category_id[int(c)]),
                ]
                for b, s, c in zip(boxes, scores, labels)
            ]
            out.append((int(image_id), rows))
        return out

    def _ground_truth(self):
        from faster_coco_eval import COCO

        if self._gt is None:
            data = json.loads(Path(self.annotations).read_text())
            for n, a in enumerate(data.get("annotations", []), 1):
                a["id"] = n  # COCOeval marks matches by annotation id, 0 meaning none: a JSON id 0 would never match
                if "area" not in a:
                    a["area"] = float(a["bbox"][2]) * float(a["bbox"][3])
                a.setdefault("iscrowd", 0)
            gt = COCO()
            gt.dataset = data
            with contextlib.redirect_stdout(io.StringIO()):
                gt.createIndex()
            self._gt = gt
        return self._gt

    def metrics(self, records: list) -> dict[str, float]:
        from faster_coco_eval import COCOeval_faster

        names = {f"ap_{metric_key(n)}": 0.0 for n in self.categories if n}  # "": a class no category declares
        evaluated = {i for i, _ in records}
        counts = {"images": float(len(evaluated)), "images_dropped": float(len(set(self.left_out) - evaluated))}
        image_ids = sorted(evaluated | set(self.left_out)) if evaluated else []
        dets = [[i, *row] for i, rows in records for row in rows]
        if not image_ids or not dets:
            return {**{k: 0.0 for k in STATS}, **names, **counts}
        gt = self._ground_truth()
        arr = np.asarray(dets, dtype=np.float64)  # (N, 7): image_id, x, y, w, h, score, category_id
        with contextlib.redirect_stdout(io.StringIO()):
            dt = gt.loadRes(arr)
            ev = COCOeval_faster(gt, dt, iouType="bbox", print_function=_quiet)
            ev.params.imgIds = image_ids
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
        out: dict[str, Any] = {k: _pct(ev.stats[i]) for k, i in STATS.items()}
        precision = ev.eval["precision"]  # (T IoUs, R recalls, K categories, A areas, M max-dets)
        for k, cat_id in enumerate(ev.params.catIds):
            label = self.label_to_category_id.index(cat_id) if cat_id in self.label_to_category_id else None
            if label is None or label >= len(self.categories):
                continue
            p = precision[:, :, k, 0, -1]
            p = p[p > -1]
            out[f"ap_{metric_key(self.categories[label])}"] = _pct(float(p.mean())) if p.size else math.nan
        return {**out, **counts}


def _quiet(*args, **kwargs) -> None:
    """faster-coco-eval's progress lines go nowhere (it logs through ``print_function``)."""


def _pct(x: float) -> float:
    """COCOeval's -1 (no ground truth in that range: undefined) as NaN; else x 100."""
    return math.nan if x is None or not math.isfinite(x) or x < 0 else 100.0 * float(x)
