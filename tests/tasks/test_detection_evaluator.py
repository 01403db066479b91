"""The COCO evaluator (faster-coco-eval) gives pycocotools' numbers on the same predictions."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch

from trainer.tasks.detection.evaluator import STATS, CocoEvaluator


def _ground_truth(rng: np.random.Generator, n_images: int = 30) -> dict:
    """Sparse category ids, crowd boxes, images without boxes, boxes in all three area ranges, no ``area``."""
    images, anns = [], []
    for i in range(n_images):
        w, h = int(rng.integers(200, 640)), int(rng.integers(200, 480))
        images.append({"id": 1000 + 3 * i, "file_name": f"{i}.jpg", "width": w, "height": h})
        for _ in range(int(rng.poisson(4)) if i % 7 else 0):
            bw, bh = float(rng.uniform(4, w / 2)), float(rng.uniform(4, h / 2))
            x, y = float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh))
            ann = {
                "id": len(anns) + 1,
                "image_id": 1000 + 3 * i,
                "category_id": int(rng.choice([1, 5, 90])),
                "bbox": [x, y, bw, bh],
            }
            if rng.random() < 0.08:
                ann["iscrowd"] = 1
            anns.append(ann)
    cats = [{"id": c, "name": f"c{c}"} for c in (1, 5, 90)]
    return {"images": images, "annotations": anns, "categories": cats}


def _predictions(rng: np.random.Generator, gt: dict) -> list:
    """Per image: jittered copies of its boxes, some with the wrong class, plus false positives; XYXY pixels."""
    by_image = {im["id"]: [] for im in gt["images"]}
    for a in gt["annotations"]:
        by_image[a["image_id"]].append(a)
    out = []
    for im in gt["images"]:
        rows = []
        for a in by_image[im["id"]]:
            x, y, w, h = a["bbox"]
            j = rng.normal(0, 0.08, 4) * [w, h, w, h]
            label = [1, 5, 90].index(a["category_id"]) if rng.random() < 0.85 else int(rng.integers(3))
            rows.append(([x + j[0], y + j[1], x + w + j[2], y + h + j[3]], float(rng.random()), label))
        for _ in range(int(rng.integers(0, 6))):
            x, y = float(rng.uniform(0, im["width"] - 20)), float(rng.uniform(0, im["height"] - 20))
            rows.append(([x, y, x + rng.uniform(5, 80), y + rng.uniform(5, 80)], float(rng.random()) * 0.5, 0))
        boxes = torch.tensor([r[0] for r in rows], dtype=torch.float32).reshape(-1, 4)
        out.append(
            (
                im["id"],
                {
                    "boxes": boxes,
                    "scores": torch.tensor([r[1] for r in rows]),
                    "labels": torch.tensor([r[2] for r in rows], dtype=torch.int64),
                },
            )
        )
    return out


def _pycocotools(path, records) -> tuple[np.ndarray, np.ndarray]:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    data = json.loads(path.read_text())
    for a in data["annotations"]:
        a.setdefault("area", a["bbox"][2] * a["bbox"][3])
        a.setdefault("iscrowd", 0)
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = data
        gt.createIndex()
        dets = np.asarray([[i, *row] for i, rows in records for row in rows], dtype=np.float64)
        ev = COCOeval(gt, gt.loadRes(dets), iouType="bbox")
        ev.params.imgIds = sorted({i for i, _ in records})
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return np.asarray(ev.stats), ev.eval["precision"]


def test_map_and_per_class_ap_equal_pycocotools(tmp_path):
    rng = np.random.default_rng(52)
    gt = _ground_truth(rng)
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt))
    ev = CocoEvaluator(path, label_to_category_id=(1, 5, 90), categories=("c1", "c5", "c90"))
    ev.reset()
    preds = _predictions(rng, gt)[:-3]  # the last 3 images are not evaluated: only evaluated images count
    for image_id, det in preds:
        ev.update([det], {"image_ids": [image_id]})
    m = ev.compute()
    stats, precision = _pycocotools(path, ev.items)  # the very records the evaluator scored
    for key, i in STATS.items():
        assert m[key] == pytest.approx(100 * stats[i], abs=1e-9), key
    assert 5 < m["map"] < 95  # a non-trivial case: neither everything nor nothing found
    for k, name in enumerate(("c1", "c5", "c90")):
        p = precision[:, :, k, 0, -1]
        assert m[f"ap_{name}"] == pytest.approx(100 * p[p > -1].mean(), abs=1e-9), name
    assert m["images"] == len(preds)


def test_a_ground_truth_annotation_id_0_is_matched_like_any_other(tmp_path):
    """COCOeval marks a match by the annotation's id and 0 means none: without renumbering, the box with id 0
    is found but scored a false positive (pycocotools and faster-coco-eval alike), so AP < 100."""
    gt = {
        "images": [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 100}],
        "annotations": [
            {"id": 0, "image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 40]},
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [60, 60, 30, 30]},
        ],
        "categories": [{"id": 1, "name": "thing"}],
    }
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt))
    ev = CocoEvaluator(path, label_to_category_id=(1,), categories=("thing",))
    ev.reset()
    boxes = torch.tensor([[10.0, 10, 50, 50], [60, 60, 90, 90]])
    ev.update(
        [{"boxes": boxes, "scores": torch.tensor([0.9, 0.8]), "labels": torch.zeros(2, dtype=torch.int64)}],
        {"image_ids": [1]},
    )
    m = ev.compute()
    assert m["map"] == pytest.approx(100.0) and m["ap_thing"] == pytest.approx(100.0)


def test_dropped_images_stay_as_missed_detections_and_undefined_aps_print_as_a_dash(tmp_path):
    """An image the reader dropped (a zero-area box, a missing file) keeps its ground truth in COCOeval's image set
    (before, dropping it raised mAP); an area range without ground truth is undefined: NaN, printed ``-``."""
    from trainer.engine.logging import format_kv

    images = [{"id": i, "file_name": f"{i}.jpg", "width": 200, "height": 200} for i in (1, 2)]
    anns = [{"id": i, "image_id": i, "category_id": 1, "bbox": [10, 10, 120, 120]} for i in (1, 2)]  # large only
    path = tmp_path / "gt.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": [{"id": 1, "name": "a"}]}))
    found = {
        "boxes": torch.tensor([[10.0, 10, 130, 130]]),
        "scores": torch.tensor([0.9]),
        "labels": torch.zeros(1, dtype=torch.int64),
    }

    def score(left_out):
        ev = CocoEvaluator(path, (1,), ("a",), left_out)
        ev.reset()
        ev.update([found], {"image_ids": [1]})  # image 2 was dropped by the reader
        return ev.compute()

    alone, with_dropped = score(()), score((2,))
    assert alone["map"] == pytest.approx(100.0) and alone["images_dropped"] == 0
    assert with_dropped["map"] < 60 and with_dropped["mar_100"] == pytest.approx(50.0)
    assert with_dropped["images"] == 1 and with_dropped["images_dropped"] == 1
    assert np.isnan(with_dropped["map_small"]) and np.isnan(with_dropped["map_medium"])
    assert "map_small=- map_medium=-" in format_kv(with_dropped)
