"""End-to-end learning proof for ``task: detection``: DINO-4scale overfits a few facemask images.

Matching, losses, denoising, post-processing and the COCO evaluator only agree if a model trained on a few images
finds them again: mAP@0.5 on the training images themselves must clear a threshold. The images are chosen from
../shared/data/facemask-coco's train split for one large face each (the face's shorter side is 48-67 % of the
image's shorter side), so a CPU-sized DINO at 128 px sees them at a useful size.

Recipe (every knob is an existing config value; nothing is monkeypatched):

- data: 4 single-face images; the training JSON lists each image ``REPEATS`` times under distinct ids (the same
  file and box), so one epoch holds several optimizer steps and the per-epoch cost (evaluation, checkpoint)
  is paid less often; the validation JSON lists each image once (mAP on exactly the training images).
- augmentation off: ``min_scale = max_scale`` (no multi-scale resize), ``hflip_prob: 0`` and ``crop_prob: 0``
  (no random flip, no crop branch): an overfit measures learning, not invariance.
- model: resnet18 (random init), hidden 64, 1 encoder / 2 decoder layers, 20 queries (num_select 20), dn_number 5.
- optimisation: AdamW, lr 3e-4 with backbone_lr_scale 1.0, cosine (no warmup), gradient_clip 0.1, float32,
  batch 4, 30 epochs x 4 steps = 120 steps, seed 0.

Measured 2026-11-25 (AMD EPYC, 2 vCPUs, other jobs running; `TRAINSTACK_OVERFIT_SEED=N OMP_NUM_THREADS=T .venv/bin/python -m pytest
tests/tasks/test_detection_learning.py`), val
mAP@0.5 on the 4 images, per seed: seed 0 (1 thread) 0 until epoch 12, 100 at epochs 13-20, last 56; seed 1
(1 thread) best 50, last 50; seed 2 (2 threads) best and last 75; seed 3 (1 thread) 100 from epoch 13 to the end;
112-138 s each. A model that has not learnt scores 0 (all four runs until epoch 8 or later). Thresholds: the
best epoch >= 25 and the last >= 25 (half the worst seed's figure), train_loss below 0.6 x its first epoch.
With the flip and crop branch on (DINO's defaults) the same recipe was seed-sensitive (seed 0: last 75.7; seeds
1 and 2: 26 and 25 after 80 steps), hence the switches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trainer.config import load_config
from trainer.engine.distributed import DistInfo

pytestmark = pytest.mark.slow

CPU = DistInfo(0, 0, 1, torch.device("cpu"))
#: facemask-coco train ids with one large face each (with_mask): (width x height, face box w x h in pixels)
#: 452: 600x399, 269x340; 119: 381x492, 241x282; 431: 267x400, 167x191; 343: 400x225, 137x156.
IMAGE_IDS = (452, 119, 431, 343)
REPEATS = 4
#: Asserted on the last epoch's mAP@0.5 (%) on the training images (measured: see the module docstring).
MAP50_THRESHOLD = 25.0


def overfit_data(shared_data: Path, out: Path, image_ids=IMAGE_IDS, repeats: int = REPEATS) -> dict:
    """COCO JSONs of ``image_ids`` (facemask-coco train): ``instances_train.json`` lists each image ``repeats``
    times under new ids (same file, same boxes), ``instances_val.json`` once; returns the config overrides."""
    src = shared_data / "facemask-coco"
    data = json.loads((src / "annotations" / "custom_train.json").read_text())
    images = [i for i in data["images"] if i["id"] in image_ids]
    anns = [a for a in data["annotations"] if a["image_id"] in image_ids]
    assert len(images) == len(image_ids), "facemask-coco changed: pick other images"
    stride = 1 + max(i["id"] for i in data["images"])
    astride = 1 + max(a["id"] for a in data["annotations"])
    train = {
        "images": [{**i, "id": i["id"] + r * stride} for r in range(repeats) for i in images],
        "annotations": [
            {**a, "id": a["id"] + r * astride, "image_id": a["image_id"] + r * stride}
            for r in range(repeats)
            for a in anns
        ],
        "categories": data["categories"],
    }
    val = {"images": images, "annotations": anns, "categories": data["categories"]}
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    (out / "annotations" / "instances_train.json").write_text(json.dumps(train))
    (out / "annotations" / "instances_val.json").write_text(json.dumps(val))
    return {"task": "detection", "data_dir": str(out), "coco_images": str(src / "train2017")}


def _cfg(data: dict, tmp_path: Path, **kw):
    base = dict(
        model="resnet18",
        min_scale=128,
        max_scale=128,
        max_size=192,
        eval_size=128,
        num_queries=20,
        num_select=20,
        dn_number=5,
        hidden_dim=64,
        dim_feedforward=128,
        enc_layers=1,
        dec_layers=2,
        nheads=4,
        optimizer="adamw",
        lr=3e-4,
        backbone_lr_scale=1.0,
        weight_decay=1e-4,
        gradient_clip=0.1,
        precision="32",
        device="cpu",
        batch_size=4,
        epochs=30,
        num_workers=0,
        channels_last=False,
        seed=int(os.environ.get("TRAINSTACK_OVERFIT_SEED", "0")),
        hflip_prob=0.0,
        crop_prob=0.0,
        # only the latest and the best checkpoint stay on disk (each is ~135 MB with AdamW's state)
        checkpoint_interval=1_000_000,
        checkpoint_dir=str(tmp_path / "ck"),
        log_dir=str(tmp_path / "logs"),
        log_every_steps=1000,
    )
    return load_config(None, {**base, **data, **kw})


def test_dino_overfits_four_images(shared_data, tmp_path):
    from trainer.engine.trainer import Trainer

    t = Trainer(_cfg(overfit_data(shared_data, tmp_path), tmp_path), CPU)
    last = t.fit()
    t.close()
    first = t.history[0]
    assert last["val_images"] == len(IMAGE_IDS)
    assert last["train_loss"] < 0.6 * first["train_loss"], (first["train_loss"], last["train_loss"])
    curve = [round(h["val_map_50"], 1) for h in t.history]
    assert max(curve) >= MAP50_THRESHOLD and last["val_map_50"] >= MAP50_THRESHOLD, curve
