"""``python -m trainer predict`` on real tiny checkpoints: a 1-epoch digits classifier (EMA and model weights) and
a 1-step DINO on facemask images (boxes drawn, COCO-format records), and its bad-input table (exit 2, one line,
no traceback; an undecodable image among good ones is skipped with a warning naming it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from bad_input_table import Case, run_case, trainer_cmd
from conftest import tiny_overrides, write_tiny_digits
from PIL import Image
from test_detection import TINY as TINY_DINO

from tests.shared_once import shared_once
from trainer.cli import main
from trainer.config import load_config
from trainer.engine.distributed import DistInfo

CPU = DistInfo(0, 0, 1, torch.device("cpu"))


def _fit(cfg):
    from trainer.engine.trainer import Trainer

    t = Trainer(cfg, CPU)
    t.fit()
    t.close()
    return t


@pytest.fixture(scope="module")
def digits_run():
    """(checkpoint_dir of a 1-epoch digits run with EMA, a folder of 4 val digit PNGs): trained once per test
    run, with its own copy of the tiny digits, for every module and worker (:mod:`tests.shared_once`); the
    tests only read it (one copies it before corrupting the copy)."""

    def make(folder: Path) -> None:
        data = write_tiny_digits(folder / "data")
        _fit(load_config(None, tiny_overrides(data, folder, epochs=1, use_ema=True, ema_decay=0.9)))
        pngs = folder / "pngs"
        pngs.mkdir()
        for c in ("1", "7"):
            for f in sorted((data / "val" / c).iterdir())[:2]:
                shutil.copy(f, pngs / f"d{c}_{f.name}")

    folder = shared_once("digits_run", make)
    return folder / "ckpt", folder / "pngs"


def test_classification_predicts_top5_class_names_and_draws_each_image(digits_run, tmp_path, capsys):
    ckpt_dir, pngs = digits_run
    out = tmp_path / "out"
    assert main(["predict", "--checkpoint", str(ckpt_dir), "--images", str(pngs), "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"predict: 4 images -> {out}") and "ema weights" in line
    records = json.loads((out / "predictions.json").read_text())
    assert [r["file"] for r in records] == sorted(p.name for p in pngs.iterdir())
    classes = [str(i) for i in range(10)]
    for r in records:
        assert len(r["top5"]) == 5 and all(t["label"] in classes for t in r["top5"])
        scores = [t["score"] for t in r["top5"]]
        assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1.0001
        drawn = np.asarray(Image.open(out / (Path(r["file"]).stem + ".png")))
        assert drawn.shape == (256, 256, 3)  # 8x8 upscaled 32x for a legible caption
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{p.stem}.png" for p in pngs.iterdir()] + ["predictions.json"]
    )

    # one checkpoint folder, the model's own weights, --limit
    latest = ckpt_dir / (ckpt_dir / "latest").read_text().strip()
    out2 = tmp_path / "out2"
    argv = ["predict", "--checkpoint", str(latest), "--images", str(pngs), "--out", str(out2), "--no-ema"]
    assert main([*argv, "--limit", "2", "--batch-size", "1"]) == 0
    assert "model weights" in capsys.readouterr().out
    assert len(json.loads((out2 / "predictions.json").read_text())) == 2


def _facemask_subset(shared_data: Path, out: Path, n: int) -> tuple[dict, list]:
    """COCO JSONs of facemask's first ``n`` train images as both splits (as tests/tasks/test_detection.py)."""
    src = shared_data / "facemask-coco"
    data = json.loads((src / "annotations" / "custom_train.json").read_text())
    images = data["images"][:n]
    ids = {i["id"] for i in images}
    sub = {
        "images": images,
        "annotations": [a for a in data["annotations"] if a["image_id"] in ids],
        "categories": data["categories"],
    }
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        (out / "annotations" / f"instances_{split}.json").write_text(json.dumps(sub))
    return {"task": "detection", "data_dir": str(out), "coco_images": str(src / "train2017")}, images


def test_detection_draws_boxes_and_writes_coco_results(shared_data, tmp_path, capsys):
    data, images = _facemask_subset(shared_data, tmp_path, 2)
    cfg = load_config(
        None,
        {
            **TINY_DINO,
            **data,
            "optimizer": "adamw",
            "lr": 1e-4,
            "precision": "32",
            "device": "cpu",
            "batch_size": 2,
            "epochs": 1,
            "max_steps_per_epoch": 1,
            "num_workers": 0,
            "channels_last": False,
            "checkpoint_dir": str(tmp_path / "ck"),
            "log_dir": str(tmp_path / "logs"),
        },
    )
    t = _fit(cfg)
    label_space = t.label_space
    src = Path(data["coco_images"])
    pngs = tmp_path / "imgs"
    pngs.mkdir()
    for im in images:
        shutil.copy(src / im["file_name"], pngs / im["file_name"])
    out = tmp_path / "out"
    argv = ["predict", "--checkpoint", str(tmp_path / "ck"), "--images", str(pngs), "--out", str(out)]
    assert main([*argv, "--score-threshold", "0"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    records = json.loads((out / "predictions.json").read_text())
    assert f"predict: 2 images -> {out} ({len(records)} detections above 0;" in line
    assert len(records) == 2 * cfg.num_select  # threshold 0: every selected query of both images
    sizes = {im["file_name"]: (im["width"], im["height"]) for im in images}
    files = sorted(sizes)
    for r in records:
        assert set(r) == {"file", "image_id", "category_id", "category", "bbox", "score"}
        assert r["image_id"] == files.index(r["file"])
        k = label_space["categories"].index(r["category"])
        assert r["category_id"] == label_space["category_ids"][k]
        x, y, w, h = r["bbox"]
        W, H = sizes[r["file"]]
        assert 0 <= x <= x + w <= W + 0.01 and 0 <= y <= y + h <= H + 0.01 and w >= 0 and h >= 0
        assert 0 <= r["score"] <= 1
    for f in files:
        drawn = np.asarray(Image.open(out / (Path(f).stem + ".png")).convert("RGB"))
        original = np.asarray(Image.open(pngs / f).convert("RGB"))
        scale = drawn.shape[0] // original.shape[0]
        assert drawn.shape[:2] == (original.shape[0] * scale, original.shape[1] * scale)
        upscaled = original.repeat(scale, 0).repeat(scale, 1)
        assert (drawn != upscaled).any(axis=2).mean() > 0.001  # boxes and captions were drawn

    # a higher threshold keeps a subset
    out2 = tmp_path / "out2"
    argv2 = ["predict", "--checkpoint", str(tmp_path / "ck"), "--images", str(pngs), "--out", str(out2)]
    assert main([*argv2, "--score-threshold", "1"]) == 0
    assert json.loads((out2 / "predictions.json").read_text()) == []
    assert "(0 detections above 1;" in capsys.readouterr().out


# --- bad inputs ---------------------------------------------------------------------------------------------
def _corrupt_among_good(tmp: Path, ckpt: Path, pngs: Path) -> list[str]:
    imgs = tmp / "imgs"
    shutil.copytree(pngs, imgs)
    (imgs / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return trainer_cmd("predict", "--checkpoint", str(ckpt), "--images", "imgs", "--out", "out", "--device", "cpu")


def _all_corrupt(tmp: Path, ckpt: Path, pngs: Path) -> list[str]:
    (tmp / "imgs").mkdir()
    (tmp / "imgs" / "a.jpg").write_bytes(b"garbage")
    return trainer_cmd("predict", "--checkpoint", str(ckpt), "--images", "imgs", "--out", "out")


def _empty_images(tmp: Path, ckpt: Path, pngs: Path) -> list[str]:
    (tmp / "imgs").mkdir()
    (tmp / "imgs" / "notes.txt").write_text("no images here")
    return trainer_cmd("predict", "--checkpoint", str(ckpt), "--images", "imgs", "--out", "out")


def _out_is_file(tmp: Path, ckpt: Path, pngs: Path) -> list[str]:
    (tmp / "out").write_text("a file")
    return trainer_cmd("predict", "--checkpoint", str(ckpt), "--images", str(pngs), "--out", "out")


def _no_checkpoint(tmp: Path, ckpt: Path, pngs: Path) -> list[str]:
    return trainer_cmd("predict", "--checkpoint", "nope", "--images", str(pngs), "--out", "out")


def _empty_checkpoint_dir(tmp: Path, ckpt: Path, pngs: Path) -> list[str]:
    (tmp / "ck").mkdir()
    return trainer_cmd("predict", "--checkpoint", "ck", "--images", str(pngs), "--out", "out")


def _corrupt_checkpoint(tmp: Path, ckpt: Path, pngs: Path) -> list[str]:
    latest = ckpt / (ckpt / "latest").read_text().strip()
    shutil.copytree(latest, tmp / "ckpt-x")
    with open(tmp / "ckpt-x" / "state.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 16)
    return trainer_cmd("predict", "--checkpoint", "ckpt-x", "--images", str(pngs), "--out", "out")


def _track_untracked(tmp: Path, ckpt: Path, pngs: Path) -> list[str]:
    return trainer_cmd("predict", "--checkpoint", str(ckpt), "--images", str(pngs), "--out", "out", "--track")


def _no_output(tmp: Path) -> None:
    assert not (tmp / "out" / "predictions.json").exists()


def _skipped_broken(tmp: Path) -> None:
    records = json.loads((tmp / "out" / "predictions.json").read_text())
    assert len(records) == 4 and "broken.png" not in {r["file"] for r in records}
    assert not (tmp / "out" / "broken.png").exists()


#: (id, setup(tmp, checkpoint_dir, pngs) -> argv, exit, fragment of the last stderr line, survived)
ROWS = [
    ("missing-checkpoint", _no_checkpoint, 2, "error: --checkpoint: nope does not exist", _no_output),
    ("checkpoint-dir-without-checkpoints", _empty_checkpoint_dir, 2, "holds no valid checkpoint", _no_output),
    ("corrupt-checkpoint", _corrupt_checkpoint, 2, "SHA-256 differs from the manifest (corrupt)", _no_output),
    ("images-dir-without-images", _empty_images, 2, "error: --images: imgs holds no image files", _no_output),
    ("out-is-a-file", _out_is_file, 2, "error: --out: out exists and is not a folder", None),
    ("no-image-readable", _all_corrupt, 2, "error: --images: none of the 1 image file(s)", _no_output),
    ("track-without-tracked-run", _track_untracked, 2, "holds no tracked run (its training ran without", _no_output),
    (
        "one-corrupt-image-among-good",
        _corrupt_among_good,
        0,
        "warning: --images: skipping imgs/broken.png",
        _skipped_broken,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_inputs(row, digits_run, tmp_path):
    name, setup, code, message, survived = row
    ckpt, pngs = digits_run
    case = Case(name, lambda t: setup(t, ckpt, pngs), code, message, survived, env={"OMP_NUM_THREADS": "1"})
    proc = run_case(case, tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert all(line.startswith("warning: --images: skipping ") for line in lines[: -1 if code else None]), lines
    if code:
        assert lines[-1].startswith("error: "), lines


def test_segmentation_writes_class_index_masks_and_overlays(shared_data, tmp_path, capsys):
    """A short RID run, then predict on two tiles: one class-index PNG per tile at the file's size (ids within
    the classes), one overlay PNG that differs from the tile, and per-class pixel counts that add up."""
    from test_segmentation import rid_cfg

    cfg = rid_cfg(shared_data, tmp_path, max_steps_per_epoch=1)
    t = _fit(cfg)
    pngs = tmp_path / "imgs"
    pngs.mkdir()
    for name in ("1011.png", "1055.png"):
        shutil.copy(shared_data / "rid-roofs" / "images" / name, pngs / name)
    # an input named like another input's mask output: its files must not overwrite 1011's class-index mask
    shutil.copy(shared_data / "rid-roofs" / "images" / "1055.png", pngs / "1011_mask.png")
    out = tmp_path / "out"
    assert main(["predict", "--checkpoint", str(tmp_path / "ck"), "--images", str(pngs), "--out", str(out)]) == 0
    assert f"predict: 3 images -> {out} (3 records;" in capsys.readouterr().out.strip().splitlines()[-1]
    records = json.loads((out / "predictions.json").read_text())
    assert [r["file"] for r in records] == ["1011.png", "1011_mask.png", "1055.png"]
    written = [r[k] for r in records for k in ("mask", "overlay")]
    assert len(set(written)) == 6 and records[0]["mask"] == "1011_mask.png", written
    for r in records:
        mask = np.asarray(Image.open(out / r["mask"]))
        assert mask.shape == (512, 512) and int(mask.max()) < len(t.label_space["classes"])
        assert sum(r["pixels"].values()) == 512 * 512 and set(r["pixels"]) == set(cfg.classes)
        overlay = np.asarray(Image.open(out / r["overlay"]).convert("RGB"))
        original = np.asarray(Image.open(pngs / r["file"]).convert("RGB"))
        assert overlay.shape == original.shape and (overlay != original).any()


def test_a_corrupt_newest_checkpoint_is_named_when_predict_and_export_fall_back(digits_run, tmp_path, capsys):
    """A checkpoint_dir whose newest checkpoint (the ``latest`` pointer's) is corrupt: predict and export use the
    older one that validates, and say which they skipped and why."""
    src, pngs = digits_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    older = (ckpt / "latest").read_text().strip()
    step = int(older.removeprefix("ckpt-"))
    newer = f"ckpt-{step + 1:09d}"
    shutil.copytree(ckpt / older, ckpt / newer)
    with open(ckpt / newer / "state.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 16)
    (ckpt / "latest").write_text(newer)
    warning = f"warning: --checkpoint: skipped {newer} ("
    assert main(["predict", "--checkpoint", str(ckpt), "--images", str(pngs), "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr()
    (line,) = [x for x in out.err.splitlines() if x.startswith(warning)]
    assert "SHA-256 differs from the manifest (corrupt)" in line and line.endswith(f"using the older {older}")
    assert f"; {older}, ema weights)" in out.out
    argv = ["export", "--checkpoint", str(ckpt), "--format", "safetensors", "--out", str(tmp_path / "e")]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert [x for x in out.err.splitlines() if x.startswith(warning)] == [line] and f"; {older}, ema" in out.out


def test_segmentation_masks_do_not_depend_on_the_batch_and_evaluate_reads_the_checkpoint(shared_data, tmp_path, capsys):
    """Tiles of three sizes (RID tiles, some cropped): the class-index masks at --batch-size 8 and 1 agree (before
    2026-11-28, 26 % of the pixels changed: batch padding moved the border features and the sliding windows); at
    most 0.1 % may differ (a near-tied argmax flipped by float rounding of a batched convolution). Then
    ``evaluate --checkpoint`` prints the run's mIoU without training."""
    import yaml
    from test_segmentation import rid_cfg

    from trainer.trained import read_state

    cfg = rid_cfg(shared_data, tmp_path, max_steps_per_epoch=1)
    _fit(cfg)
    pngs = tmp_path / "imgs"
    pngs.mkdir()
    for k, f in enumerate(sorted((shared_data / "rid-roofs" / "images").iterdir())[:8]):
        im = Image.open(f)
        (im.crop((0, 0, 512, 300 + 40 * k)) if k % 3 == 1 else im).save(pngs / f.name)
    masks = {}
    for b in (1, 8):
        out = tmp_path / f"out{b}"
        argv = ["predict", "--checkpoint", str(tmp_path / "ck"), "--images", str(pngs), "--out", str(out)]
        assert main([*argv, "--batch-size", str(b)]) == 0
        masks[b] = [np.asarray(Image.open(out / f"{f.stem}_mask.png")) for f in sorted(pngs.iterdir())]
    changed = sum(int((a != c).sum()) for a, c in zip(masks[1], masks[8]))
    assert changed <= 1e-3 * sum(a.size for a in masks[1]), changed
    config = tmp_path / "run.yaml"
    saved = read_state(next((tmp_path / "ck").glob("ckpt-*")))["config"]
    config.write_text(yaml.safe_dump({k: v for k, v in saved.items() if v is not None}))
    capsys.readouterr()
    assert main(["evaluate", "--config", str(config), "--checkpoint", str(tmp_path / "ck")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("evaluate: ckpt-"))
    assert " miou=" in line and " pixel_acc=" in line and "(model weights) on " in line


def test_evaluate_a_classifier_checkpoint(digits_run, tmp_path, capsys):
    """``evaluate --checkpoint`` on the digits run (EMA weights by default): its top-1 accuracy, no training."""
    import yaml

    from trainer.trained import read_state, resolve_checkpoint

    ckpt, _ = digits_run
    saved = read_state(resolve_checkpoint(ckpt))["config"]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in saved.items() if v is not None}))
    assert main(["evaluate", "--config", str(config), "--checkpoint", str(ckpt)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("evaluate: ckpt-"))
    assert "(ema weights) on val: " in line and " top1=" in line and " top5=" in line
    # no --config: the checkpoint's own config, with train's fields overridden by --set: the same metrics
    assert main(["evaluate", "--checkpoint", str(ckpt), "--set", "num_workers=0", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    alone = next(x for x in out.out.splitlines() if x.startswith("evaluate: ckpt-"))
    assert alone == line
    printed = (out.out + out.err).splitlines()
    data_lines = [x for x in printed if x.startswith("data: ")]
    assert data_lines and len(data_lines) == len(set(data_lines)), printed  # the split's summary once
    assert not any(x.startswith("checkpoint: writer") for x in printed), printed  # no writer started
    assert main(["evaluate", "--checkpoint", str(ckpt), "--set", "num_workers"]) == 2
    assert "error: --set 'num_workers': expected FIELD=VALUE" in capsys.readouterr().err
