"""The detection plug-in (DINO-4scale on COCO data) against the task contract, on small real data
(../shared/data/facemask-coco subsets): device batches and the model step with the targets in the forward, the
COCO evaluator (perfect detections score 100, nothing scores 0, per-class keys), the config checks, and a short
training run through the unchanged engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from catalog.metrics import TASK_METRICS
from trainer.config import ConfigError, load_config
from trainer.engine.distributed import DistInfo
from trainer.errors import DataError
from trainer.tasks import build_task

CPU = DistInfo(0, 0, 1, torch.device("cpu"))
#: A DINO small enough for CPU tests (upstream: hidden 256, 6 + 6 layers, 900 queries).
TINY = dict(
    model="resnet18",
    min_scale=64,
    max_scale=64,
    max_size=96,
    eval_size=64,
    num_queries=30,
    num_select=30,
    dn_number=10,
    hidden_dim=32,
    dim_feedforward=64,
    enc_layers=1,
    dec_layers=2,
    nheads=4,
)


def facemask_subset(shared_data: Path, out: Path, n_train: int, n_val: int, same: bool = False) -> dict:
    """Write COCO JSONs of the first images of facemask's train split under ``out/annotations`` and return the
    config overrides that read them (images from the shared folder; ``same``: val = the train images)."""
    src = shared_data / "facemask-coco"
    data = json.loads((src / "annotations" / "custom_train.json").read_text())
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    picks = {
        "train": data["images"][:n_train],
        "val": data["images"][:n_val] if same else data["images"][n_train : n_train + n_val],
    }
    for split, images in picks.items():
        ids = {i["id"] for i in images}
        sub = {
            "images": images,
            "annotations": [a for a in data["annotations"] if a["image_id"] in ids],
            "categories": data["categories"],
        }
        (out / "annotations" / f"instances_{split}.json").write_text(json.dumps(sub))
    return {"task": "detection", "data_dir": str(out), "coco_images": str(src / "train2017")}


def _cfg(data: dict, tmp_path: Path, **kw):
    base = dict(
        TINY,
        optimizer="adamw",
        lr=1e-4,
        weight_decay=1e-4,
        gradient_clip=0.1,
        precision="32",
        device="cpu",
        batch_size=2,
        epochs=1,
        num_workers=0,
        channels_last=False,
        checkpoint_dir=str(tmp_path / "ck"),
        log_dir=str(tmp_path / "logs"),
        log_every_steps=1000,
    )
    return load_config(None, {**base, **data, **kw})


def test_detection_reports_exactly_the_catalogued_fixed_metrics():
    from trainer.tasks.detection.evaluator import CocoEvaluator
    from trainer.tasks.detection.task import LOGGED_TERMS

    fixed = {f"val_{k}" for k in CocoEvaluator.directions} | {f"train_{k}" for k in LOGGED_TERMS}
    catalogued = set(TASK_METRICS["detection"])
    assert fixed <= catalogued and catalogued - fixed == {"ema_val_map", "ema_val_map_50", "ema_val_map_75"}


def test_model_step_takes_the_targets_and_logs_each_term(shared_data, tmp_path):
    task = build_task(_cfg(facemask_subset(shared_data, tmp_path, 4, 2), tmp_path), CPU)
    data = task.build_data()
    assert data.num_outputs == 3 and data.label_space["categories"] == [
        "mask_weared_incorrect",
        "with_mask",
        "without_mask",
    ]
    torch.manual_seed(0)
    model = task.build_model(data.num_outputs)
    batch = task.train_batch(data.collate([data.train[(0, i)] for i in range(2)]))
    assert batch["image"].dtype == torch.float32 and batch["mask"].dtype == torch.bool and batch["n"] == 2
    out = task.model_step(model, batch)
    assert out.outputs["dn_meta"] is not None  # denoising queries were built from the targets in the forward
    assert set(out.terms) == {
        "loss_ce",
        "loss_bbox",
        "loss_giou",
        "loss_ce_dn",
        "loss_bbox_dn",
        "loss_giou_dn",
        "loss_ce_interm",
        "loss_bbox_interm",
        "loss_giou_interm",
    }
    assert out.loss.dim() == 0 and torch.isfinite(out.loss) and out.loss > sum(out.terms.values()) - 1e-4
    out.loss.backward()
    assert model.class_embed[0].weight.grad is not None
    model.eval()
    with torch.no_grad():
        dets = task.predict(model, task.eval_batch(data.collate([data.val[(0, 0)]])))
    assert len(dets) == 1 and dets[0]["boxes"].shape == (30, 4) and int(dets[0]["labels"].max()) < 3


def test_the_coco_evaluator_scores_ground_truth_100_and_nothing_0(shared_data, tmp_path):
    from trainer.tasks.detection.evaluator import CocoEvaluator

    data = facemask_subset(shared_data, tmp_path, 2, 6)
    task = build_task(_cfg(data, tmp_path), CPU)
    task.build_data()
    split = task.val_split
    ev = task.evaluator()
    assert isinstance(ev, CocoEvaluator)
    ev.reset()
    for i in range(len(split)):
        boxes, labels = split.targets(i)
        ev.update(
            [{"boxes": torch.as_tensor(boxes), "labels": torch.as_tensor(labels), "scores": torch.ones(len(labels))}],
            {"image_ids": [split.image_ids[i]]},
        )
    m = ev.compute()
    assert m["map"] == pytest.approx(100.0) and m["map_50"] == pytest.approx(100.0) and m["images"] == 6
    assert {"ap_mask_weared_incorrect", "ap_with_mask", "ap_without_mask"} <= set(m)
    ev.reset()
    ev.update(
        [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64), "scores": torch.zeros(0)}],
        {"image_ids": [split.image_ids[0]]},
    )
    assert ev.compute()["map"] == 0.0


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"model": "vit_b_16"}, r"model: got 'vit_b_16'; detection \(DINO-4scale\) takes a ResNet backbone"),
        ({"hidden_dim": 30, "nheads": 4}, r"hidden_dim: got 30; must be divisible by nheads \(4\) and by 32"),
        ({"hidden_dim": 48, "nheads": 4}, r"hidden_dim: got 48; must be divisible by nheads \(4\) and by 32"),
        (  # upstream's 900 queries on 128-px images: 340 tokens
            {"min_scale": 128, "max_scale": 128, "eval_size": 128, "max_size": 1333, "num_queries": 900},
            r"num_queries: 900 queries, but the smallest image \(128 x 128 px.* gives only 340 encoder tokens",
        ),
        (  # --max-size 32 caps every image at 32 px, padded to 64: 85 tokens
            {"max_size": 32, "num_queries": 100, "num_select": 100},
            r"num_queries: 100 queries, but the smallest image \(64 x 64 px: min\(min_scale, eval_size, max_size\) "
            r"= 32 padded to pad_to_multiple 64\) gives only 85 encoder tokens",
        ),
        ({"min_scale": 900}, r"min_scale: got 900; must be <= max_scale \(64\)"),
        ({"target_value": 150}, r"target_value: got 150.0; map is a percentage"),
        ({"target_metric": "top1", "target_value": 50}, r"target_metric: got 'top1'; task detection reports map"),
        ({"pretrained_backbone": "/nonexistent.pth"}, r"pretrained_backbone: /nonexistent.pth is not a file"),
    ],
)
def test_config_errors_before_any_data_is_read(kw, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        build_task(_cfg({"task": "detection", "data_dir": "/nonexistent"}, tmp_path, **kw), CPU).check_config()


def test_a_classification_field_is_refused_with_detection(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"mixup_alpha \(command line\): mixup_alpha belongs to task section "
        r"classification",
    ):
        _cfg({"task": "detection", "data_dir": "/x"}, tmp_path, mixup_alpha=0.2)


def test_more_boxes_in_one_image_than_queries_is_refused_before_training(shared_data, tmp_path):
    """facemask's train split has an image with 115 faces: with 100 queries the matcher would fail at that
    image mid-epoch (found by a 2-rank run that died in epoch 2); the check names it before any step."""
    data = {
        "task": "detection",
        "data_dir": str(shared_data / "facemask-coco"),
        "coco_annotations": "annotations/custom_{split}.json",
    }
    with pytest.raises(ConfigError, match=r"num_queries: 100 queries, but image \d+ .* has 115 boxes"):
        build_task(_cfg(data, tmp_path, num_queries=100, num_select=100), CPU).build_data()


def test_splits_with_different_categories_are_refused(shared_data, tmp_path):
    data = facemask_subset(shared_data, tmp_path, 2, 2)
    val = tmp_path / "annotations" / "instances_val.json"
    d = json.loads(val.read_text())
    d["categories"] = d["categories"][:2]
    d["annotations"] = [a for a in d["annotations"] if a["category_id"] < 2]
    val.write_text(json.dumps(d))
    with pytest.raises(DataError, match=r"the categories of .*instances_train.json and .*instances_val.json differ"):
        build_task(_cfg(data, tmp_path), CPU).build_data()


def _rewrite(path: Path, change) -> None:
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


def test_two_categories_giving_one_ap_key_are_refused(shared_data, tmp_path):
    """'with mask' and 'with-mask' both give ap_with_mask: their per-class AP would merge into one key."""
    data = facemask_subset(shared_data, tmp_path, 2, 2)
    for split in ("train", "val"):

        def rename(d):
            d["categories"][0]["name"], d["categories"][1]["name"] = "with mask", "with-mask"

        _rewrite(tmp_path / "annotations" / f"instances_{split}.json", rename)
    with pytest.raises(DataError, match=r"instances_train.json: categories share a per-class metric key \(id \d+ "):
        build_task(_cfg(data, tmp_path), CPU).build_data()


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("how", ["all-crowd", "no-annotations"])
def test_a_split_without_a_box_is_refused_before_training(shared_data, tmp_path, split, how):
    data = facemask_subset(shared_data, tmp_path, 2, 2)

    def empty(d):
        if how == "all-crowd":
            for a in d["annotations"]:
                a["iscrowd"] = 1
        else:
            d["annotations"] = []

    _rewrite(tmp_path / "annotations" / f"instances_{split}.json", empty)
    with pytest.raises(DataError, match=rf"instances_{split}.json: split {split} has no non-crowd box \(2 images"):
        build_task(_cfg(data, tmp_path), CPU).build_data()


def test_a_short_detection_run_through_the_engine(shared_data, tmp_path):
    from trainer.engine.trainer import Trainer

    t = Trainer(
        _cfg(
            facemask_subset(shared_data, tmp_path, 4, 2), tmp_path, epochs=2, batch_size=2, use_ema=True, ema_decay=0.9
        ),
        CPU,
    )
    last = t.fit()
    t.close()
    assert {"train_loss_ce", "train_loss_giou_dn", "val_map", "val_map_50", "ema_val_map"} <= set(last)
    assert t.global_step == 4 and last["val_images"] == 2.0 and t.best is not None
    assert (tmp_path / "logs" / "curves.png").is_file()


def test_seed000_wall_and_room_train_on_floor_plans(shared_data, tmp_path):
    """Seed 000's own two classes: COCO boxes built from r3d-floorplans' masks (tests/data/floorplans_coco.py:
    rooms = components per room colour, walls = wall-mask pieces), read through the config's templates, and a
    short run through the engine that scores each class (``val_ap_wall``, ``val_ap_room``)."""
    from floorplans_coco import build_floorplans_coco

    from trainer.engine.trainer import Trainer

    plans = shared_data / "r3d-floorplans"
    build_floorplans_coco(plans, tmp_path / "fp", split="train", limit=4)
    build_floorplans_coco(plans, tmp_path / "fp", split="test", limit=2)
    cfg = _cfg(
        {
            "task": "detection",
            "data_dir": str(tmp_path / "fp"),
            "coco_annotations": "floorplans_{split}.json",
            "coco_images": str(plans / "{split}"),
            "val_split": "test",
        },
        tmp_path,
        epochs=1,
    )
    data = build_task(cfg, CPU).build_data()
    assert data.label_space["categories"] == ["wall", "room"] and len(data.train) == 4 and len(data.val) == 2
    t = Trainer(cfg, CPU)
    last = t.fit()
    t.close()
    assert {"val_ap_wall", "val_ap_room", "val_map"} <= set(last) and last["val_images"] == 2.0
    assert last["train_loss_ce"] > 0 and last["train_loss_bbox"] > 0


@pytest.mark.multiprocess
def test_two_ranks_under_torchrun_gather_every_val_image(shared_data, tmp_path):
    """2 gloo ranks: the gathering evaluator scores all 5 val images once (3 on rank 0, 2 on rank 1)."""
    import yaml
    from conftest import run_trainer

    overrides = {
        **_cfg(facemask_subset(shared_data, tmp_path, 4, 5), tmp_path).to_dict(),
        "epochs": 1,
        "batch_size": 4,
        "device": "cpu",
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(overrides))
    r = run_trainer(["--config", str(tmp_path / "c.yaml")], torchrun_nproc=2, timeout=900, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    epoch = [row for row in rows if row.get("kind") == "epoch"][-1]
    assert epoch["val_images"] == 5.0 and "val_map_50" in epoch and epoch["train_loss_ce"] > 0
    assert "done: best map=" in r.stdout
