"""DINO for users coming from IDEA-Research/DINO, on facemask images re-labelled with COCO-style ids
(1, 44, 90 out of 1..90; ../shared/data/facemask-coco) and a tiny DINO checkpoint written in upstream's layout
(``{"model", "optimizer", "lr_scheduler", "epoch", "args"}``, 91 classes as upstream's ``num_classes``):

- ``label_space: coco_ids``: the class index is the category id (91 classes), the checkpoint loads with 0 tensors
  re-initialised (27 re-initialised at full size with ``contiguous``), the evaluator hands COCOeval the JSON ids;
- ``python -m trainer evaluate --init-from`` prints COCO box mAP; bad input exits 2 with one line;
- evaluation under ``eval_protocol: upstream`` with the configs' ``canvases: auto`` gives each image's detections
  of a batch of 1 without padding (upstream's protocol), within :data:`SCORE_TOL` / :data:`BOX_TOL_PX`;
- ``predict`` gives the same detections at ``--batch-size`` 1 and 8, and records carry the COCO ids and names.

Tolerances: batched and single-image forwards of the same unpadded images differ by float32 rounding only (a
convolution or matmul over a batch may sum in another order): scores within 1e-4, boxes within 0.05 px (``predict``
rounds boxes to 0.01 px and scores to 1e-4).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from test_detection import TINY

from trainer.cli import main
from trainer.config import load_config
from trainer.engine.distributed import DistInfo
from trainer.tasks import build_task

CPU = DistInfo(0, 0, 1, torch.device("cpu"))
#: facemask's category ids 0..2 -> COCO-style ids, so the label space runs to 90 (upstream's 91 classes).
COCO_IDS = {0: 1, 1: 44, 2: 90}
SCORE_TOL = 1e-4
BOX_TOL_PX = 0.05


@pytest.fixture(scope="module")
def coco90(shared_data, tmp_path_factory) -> dict:
    """Config overrides reading 4 train and 8 val facemask images (several sizes) with ids 1, 44 and 90."""
    src = shared_data / "facemask-coco"
    out = tmp_path_factory.mktemp("coco90")
    data = json.loads((src / "annotations" / "custom_train.json").read_text())
    (out / "annotations").mkdir()
    for split, images in {"train": data["images"][:4], "val": data["images"][4:12]}.items():
        ids = {i["id"] for i in images}
        sub = {
            "images": images,
            "annotations": [
                dict(a, category_id=COCO_IDS[a["category_id"]]) for a in data["annotations"] if a["image_id"] in ids
            ],
            "categories": [dict(c, id=COCO_IDS[c["id"]]) for c in data["categories"]],
        }
        (out / "annotations" / f"instances_{split}.json").write_text(json.dumps(sub))
    return {
        **TINY,
        "task": "detection",
        "data_dir": str(out),
        "coco_images": str(src / "train2017"),
        "label_space": "coco_ids",
        "device": "cpu",
        "num_workers": 0,
        "precision": "32",
        "channels_last": False,
        "batch_size": 2,
        "optimizer": "adamw",
        "log_every_steps": 1000,
    }


@pytest.fixture(scope="module")
def upstream_ckpt(coco90, tmp_path_factory) -> str:
    """A tiny DINO for 91 classes with seeded weights, saved as upstream's main.py saves (an argparse Namespace
    under ``args``); 91 = upstream's ``num_classes`` and ``dn_labelbook_size`` on COCO."""
    from trainer.models.dino.model import build_dino

    task = build_task(load_config(None, coco90), CPU)
    torch.manual_seed(1)
    model = build_dino(task.dino_config(), 91)
    path = tmp_path_factory.mktemp("upstream") / "checkpoint0011_4scale.pth"
    args = argparse.Namespace(modelname="dino", num_classes=91, dn_labelbook_size=91, lr=1e-4)
    torch.save({"model": model.state_dict(), "optimizer": {}, "lr_scheduler": {}, "epoch": 11, "args": args}, path)
    return str(path)


def test_coco_ids_refuse_a_category_id_above_max_category_id(coco90):
    """coco_ids builds max id + 1 outputs per head: one stray large id would build a huge head (10**6 was killed
    for memory at 23.5 GB); above ``max_category_id`` the data is refused in one line naming the id and file."""
    from trainer.errors import DataError

    task = build_task(load_config(None, {**coco90, "max_category_id": 89}), CPU)
    with pytest.raises(DataError) as e:
        task.build_data()
    msg = str(e.value)
    assert "\n" not in msg and "instances_train.json" in msg and "category id 90" in msg
    assert "max_category_id (89)" in msg
    assert build_task(load_config(None, {**coco90, "max_category_id": 90}), CPU).build_data().num_outputs == 91


def test_coco_ids_keep_the_category_ids_and_load_upstreams_heads(coco90, upstream_ckpt, tmp_path, capsys):
    task = build_task(load_config(None, {**coco90, "init_from": upstream_ckpt}), CPU)
    data = task.build_data()
    assert data.num_outputs == 91 and task.num_classes == 91
    labels = {int(x) for i in range(len(data.train)) for x in data.train[i][1]["labels"]}
    assert labels and labels <= set(COCO_IDS.values())
    assert data.label_space["label_space"] == "coco_ids" and data.label_space["category_ids"] == [1, 44, 90]
    task.build_model(data.num_outputs)
    assert task.init_report.reinitialised == [] and not task.init_report.skipped
    assert "re-initialised 0;" in capsys.readouterr().out
    # the same checkpoint with contiguous labels (3 classes): every class head and label_enc re-initialised
    other = build_task(load_config(None, {**coco90, "init_from": upstream_ckpt, "label_space": "contiguous"}), CPU)
    other.build_model(other.build_data().num_outputs)
    assert "label_space: coco_ids loads them as they are" in capsys.readouterr().out  # the hint
    reinit = set(other.init_report.reinitialised)
    assert {"label_enc.weight", "transformer.enc_out_class_embed.weight", "class_embed.0.weight"} <= reinit


def test_the_evaluator_gives_cocoeval_the_json_ids(coco90, tmp_path):
    """Ground truth as detections (labels = category ids) scores 100 with coco_ids."""
    task = build_task(load_config(None, coco90), CPU)
    data = task.build_data()
    ev = task.evaluator()
    for i in range(len(data.val)):
        _, target, _ = data.val[i]
        split = data.val.split
        boxes, labels = split.targets(i)
        h, w = split.sizes[i]
        assert set(labels.tolist()) <= set(COCO_IDS.values())
        det = {"scores": torch.ones(len(labels)), "labels": torch.from_numpy(labels), "boxes": torch.from_numpy(boxes)}
        ev.update([det], {"image_ids": [target["image_id"]]})
    metrics = ev.compute()
    assert metrics["map"] == pytest.approx(100.0) and metrics["ap_with_mask"] == pytest.approx(100.0)


def _detections(task, model, batch: dict) -> dict:
    with torch.no_grad():
        outs = task.predict(model, batch)
    return {i: o for i, o in zip(batch["image_ids"], outs)}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k]["labels"], b[k]["labels"]), k
        assert torch.allclose(a[k]["scores"], b[k]["scores"], atol=SCORE_TOL, rtol=0), k
        assert torch.allclose(a[k]["boxes"], b[k]["boxes"], atol=BOX_TOL_PX, rtol=0), k


def test_canvases_under_the_upstream_protocol_give_batch_1s_detections(coco90, upstream_ckpt):
    """The upstream-layout checkpoint evaluated on the configs' canvases (auto), 4 images a batch, under
    ``eval_protocol: upstream``, against each image alone without padding (upstream main.py's batch 1)."""
    from trainer.data.formats.coco_dataset import collate_detection

    cfg = load_config(
        None, {**coco90, "init_from": upstream_ckpt, "canvases": "auto", "eval_protocol": "upstream", "seed": 0}
    )
    task = build_task(cfg, CPU)
    data = task.build_data()
    model = task.build_model(data.num_outputs).eval()
    items = [data.val[i] for i in range(len(data.val))]
    sizes = {tuple(it[0].shape[-2:]) for it in items}
    assert len(sizes) > 1  # several sizes: per-batch padding would differ from image to image
    batched, single = {}, {}
    for s in range(0, len(items), 4):
        batch = data.val_collate(items[s : s + 4])
        batched.update(_detections(task, model, task.eval_batch(batch)))
    for it in items:
        alone = task._device_batch(collate_detection([it], pad_to_multiple=1))
        assert not alone["mask"].any()  # batch 1, no padding
        single.update(_detections(task, model, alone))
    _assert_same(batched, single)


def test_mean_padding_is_zero_after_normalisation_and_masks_stay_right(coco90):
    task = build_task(load_config(None, {**coco90, "canvases": "128x128"}), CPU)
    data = task.build_data()
    batch = data.val_collate([data.val[0], data.val[1]])
    assert batch["pad_value"] == "mean"
    dev = task.eval_batch(batch)
    image, mask = dev["image"], dev["mask"]
    assert image.shape[-2:] == (128, 128) and mask.any()
    assert torch.all(image.permute(0, 2, 3, 1)[mask] == 0)  # exactly the mean colour, every channel
    for i, (h, w) in enumerate(dev["sizes"]):
        assert not mask[i, :h, :w].any() and mask[i, h:, :].all() and mask[i, :, w:].all()
    black = build_task(load_config(None, {**coco90, "pad_value": "black"}), CPU)
    bb = black.eval_batch(black.build_data().val_collate([data.val[0], data.val[1]]))
    assert torch.all(bb["image"].permute(0, 2, 3, 1)[bb["mask"]] < -1.7)  # pixel 0 normalised: -2.1/-2.0/-1.8


def test_predict_batch_1_and_8_agree_and_carry_coco_ids(coco90, upstream_ckpt, tmp_path, capsys):
    from trainer.engine.trainer import Trainer

    over = {**coco90, "init_from": upstream_ckpt, "lr": 1e-4, "epochs": 1, "max_steps_per_epoch": 1}
    over.update(checkpoint_dir=str(tmp_path / "ck"), log_dir=str(tmp_path / "logs"))
    t = Trainer(load_config(None, over), CPU)
    t.fit()
    t.close()
    split = t.task.val_split
    pngs = tmp_path / "imgs"
    pngs.mkdir()
    for p in split.paths:
        shutil.copy(p, pngs / Path(p).name)
    records = {}
    for b in (1, 8):
        argv = [
            "predict",
            "--checkpoint",
            str(tmp_path / "ck"),
            "--images",
            str(pngs),
            "--out",
            str(tmp_path / f"o{b}"),
        ]
        assert main([*argv, "--batch-size", str(b), "--score-threshold", "0", "--device", "cpu"]) == 0
        records[b] = json.loads((tmp_path / f"o{b}" / "predictions.json").read_text())
    capsys.readouterr()
    names = dict(zip(split.label_to_category_id, split.categories))
    assert len(records[1]) == len(records[8]) == len(split.paths) * TINY["num_select"]
    for r1, r8 in zip(records[1], records[8]):
        assert (r1["file"], r1["category_id"], r1["category"]) == (r8["file"], r8["category_id"], r8["category"])
        assert abs(r1["score"] - r8["score"]) <= SCORE_TOL
        assert max(abs(x - y) for x, y in zip(r1["bbox"], r8["bbox"])) <= BOX_TOL_PX
        assert 0 <= r1["category_id"] <= 90 and r1["category"] == names.get(r1["category_id"], str(r1["category_id"]))


def test_evaluate_refuses_an_upstream_checkpoint_whose_class_heads_would_be_random(
    coco90, upstream_ckpt, tmp_path, capsys
):
    """contiguous labels (3 classes) against the file's 91-column heads: 27 tensors re-initialised; evaluating
    them printed mAP 0.00 and exited 0. Now exit 2, one line naming the tensors and the label-space fix."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**coco90, "label_space": "contiguous"}))
    assert main(["evaluate", "--config", str(config), "--init-from", upstream_ckpt]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --init-from: checkpoint0011_4scale.pth leaves ")
    assert "label_space: coco_ids" in err and "91 columns" in err


def test_evaluate_prints_box_map_for_an_upstream_checkpoint(coco90, upstream_ckpt, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(coco90))
    assert main(["evaluate", "--config", str(config), "--init-from", upstream_ckpt, "--eval-protocol", "upstream"]) == 0
    out = capsys.readouterr().out
    assert "init_from: loaded 229 tensors; re-initialised 0;" in out
    line = next(x for x in out.splitlines() if x.startswith("evaluate: checkpoint0011_4scale.pth (init_from) on val"))
    metrics = dict(kv.split("=") for kv in line.split(": ", 2)[2].split())
    assert {"map", "map_50", "ap_with_mask"} <= set(metrics) and metrics["images"] == "8"
    assert 0.0 <= float(metrics["map"]) <= 100.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "C"], "error: --checkpoint / --init-from: give exactly one"),
        (["--config", "C", "--checkpoint", "ck", "--init-from", "f.pth"], "give exactly one"),
        (["--config", "C", "--checkpoint", "nope"], "error: --checkpoint: nope does not exist"),
        (["--config", "C", "--init-from", "nope.pth"], "error: --init-from: nope.pth is not a file"),
        (["--config", "missing.yaml", "--init-from", "UP"], "error: --config missing.yaml: "),
        (["--config", "CLS", "--init-from", "UP"], "error: --init-from: reads upstream DINO checkpoints"),
        (["--init-from", "UP"], "error: --config: needed with --init-from"),
    ],
)
def test_evaluate_bad_input_exits_2_with_one_line(argv, message, coco90, upstream_ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "C").write_text(yaml.safe_dump(coco90))
    (tmp_path / "CLS").write_text(yaml.safe_dump({"task": "classification", "device": "cpu"}))
    argv = [upstream_ckpt if a == "UP" else a for a in argv]
    assert main(["evaluate", *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and message in err[0], err


def test_the_upstream_config_holds_upstreams_recipe():
    """configs/dino_4scale_upstream.yaml: the values of upstream's config/DINO/DINO_4scale.py and main.py, and an
    optimizer that decays every parameter (param_dict_type 'default') with the backbone at lr 1e-5."""
    from trainer.engine.optim import build_optimizer

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "dino_4scale_upstream.yaml")
    assert (cfg.lr, cfg.weight_decay, cfg.gradient_clip, cfg.batch_size, cfg.epochs) == (1e-4, 1e-4, 0.1, 16, 12)
    assert (cfg.scheduler, cfg.step_size_epochs, cfg.step_gamma, cfg.warmup_epochs) == ("step", 11, 0.1, 0)
    assert (cfg.precision, cfg.label_space, cfg.pad_value, cfg.pad_to_multiple, cfg.canvases) == (
        "32",
        "coco_ids",
        "mean",
        1,
        "",
    )
    assert (cfg.eval_protocol, cfg.eval_batch_size, cfg.num_queries, cfg.dn_number, cfg.use_ema) == (
        "upstream",
        1,
        900,
        100,
        False,
    )
    small = load_config(None, {**cfg.to_dict(), **TINY, "device": "cpu"})
    task = build_task(small, CPU)
    model = task.build_model(91)
    opt = build_optimizer(small, model, task.lr_scales())
    assert all(g["weight_decay"] == 1e-4 for g in opt.param_groups)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trained)
    backbone = {id(p) for n, p in trained if n.startswith("backbone.0.")}
    assert {id(p) for g in opt.param_groups if g["lr"] == pytest.approx(1e-5) for p in g["params"]} == backbone


def test_evaluate_reads_a_val_split_more_crowded_than_the_queries(coco90, upstream_ckpt):
    """``evaluate`` reads the val split as both splits: an image with more boxes than ``num_queries`` matters only
    to training's matcher, so it is refused for a training split and accepted when nothing is trained."""
    from trainer.errors import ConfigError

    crowded = {**coco90, "num_queries": 4, "num_select": 4}
    with pytest.raises(ConfigError, match="num_queries: 4 queries, but image"):  # the crowded split trained on
        build_task(load_config(None, {**crowded, "train_split": "val", "val_split": "train"}), CPU).build_data()
    data = build_task(load_config(None, {**crowded, "train_split": "val"}), CPU).build_data()  # as evaluate reads it
    assert len(data.val) == 8
