"""Segmentation data on the real folders and on small built ones: the pairing rules (RID's suffix, R3D's shared
folder), palette decoding with a tolerance, the bad-input policy (pairs named and counted at scan time, masks
with ids outside the classes as bad samples), joint transforms that keep image and mask aligned, the padding
collate, and the command-line rows (exit 2, one line)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from bad_input_table import Case, run_case, trainer_cmd
from PIL import Image
from torchvision import tv_tensors

from trainer.data.formats.segmentation import (
    PairingRule,
    SegmentationCollate,
    SegmentationDataset,
    TrainTransform,
    decode_mask,
    parse_palette,
    scan_pairs,
)
from trainer.data.samples import BadSample
from trainer.errors import DataError

#: DeepFloorplan's room colours (R3D ``N_rooms.png``), background first.
R3D_ROOMS = ["0,0,0", "192,192,224", "192,255,255", "224,255,192", "255,224,128", "255,160,96", "255,224,224"]


def test_rid_suffix_rule_and_a_stable_val_share(shared_data):
    rule = PairingRule(shared_data / "rid-roofs", mask_suffix="_reviewed")
    train = scan_pairs(rule, "train", 0.1, val_fraction=0.25)
    val = scan_pairs(rule, "val", 0.1, val_fraction=0.25)
    assert len(train) + len(val) == 26 and not set(train.images) & set(val.images)
    assert all(Path(m).name == Path(i).stem + "_reviewed.png" for i, m in zip(train.images, train.masks))
    assert train.sizes[0] == (512, 512) and train.report == []
    assert scan_pairs(rule, "train", 0.1, val_fraction=0.25).images == train.images  # hash of the name: stable
    assert len(scan_pairs(rule, "train", 0.1, val_fraction=0.25, max_samples=10)) == 10  # seed 001's 10 per set
    mask = decode_mask(train.masks[0], 9, 255)
    assert mask.dtype == torch.int64 and int(mask.max()) <= 8


def test_r3d_shared_folder_names_the_plans_whose_masks_differ_in_size(shared_data):
    rule = PairingRule(shared_data / "r3d-floorplans", "{split}", "{split}", "_rooms", "*.jpg")
    split = scan_pairs(rule, "train", 0.1)
    assert len(split) == 146 and all(m.endswith("_rooms.png") for m in split.masks)
    assert len(split.report) == 1 and "skipped 3 (size mismatch)" in split.report[0]
    assert "47534689.jpg is 1110x1838 but 47534689_rooms.png is 1104x1838" in split.report[0]


def test_palette_masks_decode_with_a_tolerance_and_name_unknown_colours(shared_data):
    palette = parse_palette(R3D_ROOMS, 7)
    path = str(shared_data / "r3d-floorplans" / "train" / "28025487_rooms.png")
    rgb = np.asarray(Image.open(path).convert("RGB"))
    ids = decode_mask(path, 7, 255, palette, "ignore", tolerance=8).numpy()
    assert ids.shape == rgb.shape[:2]
    assert (ids[(rgb == [224, 255, 192]).all(-1)] == 3).all() and (ids[(rgb == [0, 0, 0]).all(-1)] == 0).all()
    with pytest.raises(ValueError, match=r"colours not in the palette \(tolerance 0\): \(224,224,224\): 1088 px"):
        decode_mask(path, 7, 255, palette, "error", tolerance=0)
    ignored = decode_mask(path, 7, 255, palette, "ignore", tolerance=0).numpy()
    assert (ignored[(rgb == [224, 224, 224]).all(-1)] == 255).all()
    with pytest.raises(DataError, match=r"segmentation.palette: 7 colours for 8 classes"):
        parse_palette(R3D_ROOMS, 8)
    with pytest.raises(DataError, match=r"segmentation.palette\[1\]: got '1,2'; expected R,G,B"):
        parse_palette(["0,0,0", "1,2"], 2)


def _pair(root: Path, stem: str, size=(32, 48), ids=(0, 1), image_dir="images", mask_dir="masks", suffix=""):
    h, w = size
    rng = np.random.default_rng(len(stem))
    (root / image_dir).mkdir(parents=True, exist_ok=True)
    (root / mask_dir).mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / image_dir / f"{stem}.png")
    mask = np.zeros((h, w), np.uint8)
    mask[:, w // 2 :] = ids[1]
    mask[:, : w // 2] = ids[0]
    Image.fromarray(mask).save(root / mask_dir / f"{stem}{suffix}.png")


def test_pair_problems_are_named_counted_and_over_the_threshold_fail(tmp_path):
    for i in range(6):
        _pair(tmp_path, f"ok{i}")
    _pair(tmp_path, "lonely")
    (tmp_path / "masks" / "lonely.png").unlink()  # an image without a mask
    _pair(tmp_path, "orphan")
    (tmp_path / "images" / "orphan.png").unlink()  # a mask without an image
    _pair(tmp_path, "mismatch")
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "masks" / "mismatch.png")
    rule = PairingRule(tmp_path, "images", "masks")
    split = scan_pairs(rule, "train", 0.5, val_fraction=0.01)
    assert len(split) == 6
    text = "\n".join(split.report)
    assert "skipped 1 (image without a mask)" in text and "lonely.png" in text
    assert "skipped 1 (mask without an image)" in text and "orphan.png" in text
    assert "mismatch.png is 48x32 but mismatch.png is 8x8" in text
    with pytest.raises(DataError, match=r"3 of 9 candidate pairs of split train are bad, more than max_bad_fraction"):
        scan_pairs(rule, "train", 0.1, val_fraction=0.01)
    with pytest.raises(DataError, match=r"no per-split folders .* set val_fraction"):
        scan_pairs(rule, "train", 0.5)


def test_masks_outside_the_classes_are_bad_samples_replaced_in_training_dropped_in_evaluation(tmp_path):
    for i in range(3):
        _pair(tmp_path, f"p{i}", ids=(0, 1))
    _pair(tmp_path, "p1", ids=(0, 7))  # class 7 with 2 classes declared
    split = scan_pairs(PairingRule(tmp_path), "train", 0.5, val_fraction=0.01)
    ev = SegmentationDataset(split, lambda i, m: (i, m), 2, replace_bad=False)
    bad = ev[(0, 1)]
    assert isinstance(bad, BadSample) and "class ids [7] outside 0..1 (ignore_index 255)" in bad.error
    tr = SegmentationDataset(split, lambda i, m: (i, m), 2)
    image, mask, own = tr[(0, 1)]
    assert own == (bad,) and set(mask.unique().tolist()) == {0, 1}  # replaced by the next pair, reported once


def test_train_transform_keeps_image_and_mask_aligned_and_pads_with_ignore_index():
    h, w = 40, 60
    img = torch.zeros((3, h, w), dtype=torch.uint8)
    img[:, :, 30:] = 255
    mask = (img[0] > 127).to(torch.int64)
    t = TrainTransform(64, scale_min=0.5, scale_max=0.9, hflip_prob=0.5, ignore_index=255)
    for seed in range(6):
        torch.manual_seed(seed)
        out_img, out_mask = t(tv_tensors.Image(img), tv_tensors.Mask(mask))
        assert out_img.shape == (3, 64, 64) and out_mask.shape == (64, 64)
        pad = out_mask == 255
        assert pad.any() and (out_img[:, pad] == 0).all()  # shorter side at most 58 px < 64: padded, and ignored
        keep = ~pad
        agree = ((out_img[0] > 127).to(torch.int64) == out_mask)[keep].float().mean()
        assert agree > 0.97, (seed, agree)  # only the resampled edge column may differ


def test_collate_pads_to_the_model_divisor_with_ignore_index():
    a = (tv_tensors.Image(torch.ones((3, 30, 40), dtype=torch.uint8)), tv_tensors.Mask(torch.ones(30, 40).long()), ())
    b = (tv_tensors.Image(torch.ones((3, 33, 20), dtype=torch.uint8)), tv_tensors.Mask(torch.zeros(33, 20).long()), ())
    bad = BadSample("x.png", "OSError: truncated")
    batch = SegmentationCollate(32, 255)([a, bad, b])
    assert batch["image"].shape == (2, 3, 64, 64) and batch["mask"].shape == (2, 64, 64)
    assert batch["size"].tolist() == [[30, 40], [33, 20]] and batch["bad"] == [bad]
    assert (batch["mask"][0, 30:] == 255).all() and (batch["mask"][0, :30, :40] == 1).all()
    assert (batch["image"][1, :, :, 20:] == 0).all()


def _seg_argv(tmp: Path, data: Path, *extra: str) -> list[str]:
    return trainer_cmd(
        "train",
        "--task",
        "segmentation",
        "--data-dir",
        str(data),
        "--classes",
        "a,b",
        "--val-fraction",
        "0.3",
        "--model",
        "unet",
        "--encoder",
        "resnet18",
        "--image-size",
        "32",
        "--batch-size",
        "2",
        "--epochs",
        "1",
        "--device",
        "cpu",
        "--num-workers",
        "0",
        "--checkpoint-dir",
        str(tmp / "ck"),
        "--log-dir",
        str(tmp / "logs"),
        *extra,
    )


def _pairs(tmp: Path, n: int = 6, **kw) -> Path:
    for i in range(n):
        _pair(tmp / "d", f"p{i}", **kw)
    return tmp / "d"


def _nothing_trained(tmp: Path) -> None:
    assert not (tmp / "ck").exists() or not any((tmp / "ck").iterdir())


CASES = [
    Case("seg-no-mask-folder", lambda t: _seg_argv(t, t), 2, "seg_images:", _nothing_trained),
    Case(
        "seg-one-class", lambda t: _seg_argv(t, _pairs(t), "--classes", "a"), 2, "classes: got ['a']", _nothing_trained
    ),
    Case(
        "seg-size-not-multiple",
        lambda t: _seg_argv(t, _pairs(t), "--image-size", "40"),
        2,
        "image_size: got 40; unet needs a multiple of 32",
        _nothing_trained,
    ),
    Case(
        "seg-ignore-index-is-a-class",
        lambda t: _seg_argv(t, _pairs(t), "--ignore-index", "1"),
        2,
        "ignore_index: got 1; must be outside the class ids 0..1",
        _nothing_trained,
    ),
    Case(
        "seg-palette-size",
        lambda t: _seg_argv(t, _pairs(t), "--palette", "0,0,0;255,255,255;1,2,3"),
        2,
        "segmentation.palette: 3 colours for 2 classes",
        _nothing_trained,
    ),
    Case(
        "seg-every-mask-outside-the-classes",
        lambda t: _seg_argv(t, _pairs(t, ids=(5, 6))),
        2,
        "val masks of split val are bad, more than max_bad_fraction",
        _nothing_trained,
    ),
    Case(
        "seg-a-val-mask-outside-the-classes-before-training",
        lambda t: _seg_argv(t, _one_bad_val_mask(t), "--max-bad-fraction", "0"),
        2,
        "class ids [7] outside 0..1",
        _nothing_trained,
    ),
    Case(
        "seg-every-val-mask-ignore-index",
        lambda t: _seg_argv(t, _pairs(t, ids=(255, 255))),
        2,
        "is ignore_index 255 only; mIoU needs labelled pixels",
        _nothing_trained,
    ),
    Case(
        "seg-float-masks-with-fractions",
        lambda t: _seg_argv(t, _float_masks(t)),
        2,
        "a float mask with fractional values [0.5]; expected whole class ids",
        _nothing_trained,
    ),
]


def _val_stems(data: Path, fraction: float = 0.3) -> list[str]:
    from trainer.data.formats.segmentation.pairs import _hash_unit

    return sorted(p.stem for p in (data / "images").glob("*.png") if _hash_unit(p.name) < fraction)


def _one_bad_val_mask(tmp: Path) -> Path:
    data = _pairs(tmp)
    stem = _val_stems(data)[0]
    _pair(data, stem, ids=(0, 7))
    return data


def _float_masks(tmp: Path) -> Path:
    data = _pairs(tmp)
    for mask in (data / "masks").glob("*.png"):
        values = np.asarray(Image.open(mask)).astype(np.float32)
        values[0, 0] = 0.5
        mask.unlink()
        Image.fromarray(values, mode="F").save(mask.with_suffix(".tif"))
    return data


def test_a_bad_val_mask_is_left_out_before_training_and_counted_every_epoch(tmp_path):
    """One val mask outside the classes (within max_bad_fraction): named in the log before the first step, left
    out of the metrics, and counted in every epoch's val_bad_files (it was reported as 0)."""
    import json
    import subprocess

    from bad_input_table import REPO

    data = _one_bad_val_mask(tmp_path)
    assert len(_val_stems(data)) >= 2, "the row needs a good val pair beside the bad one"
    proc = subprocess.run(
        _seg_argv(tmp_path, data, "--max-bad-fraction", "0.6", "--max-steps-per-epoch", "1"),
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "val mask(s) cannot be used; left out:" in out and "class ids [7] outside 0..1" in out
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if "val_bad_files" in r]
    assert epochs and all(r["val_bad_files"] == 1 for r in epochs), epochs


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_segmentation_input(case, tmp_path):
    run_case(case, tmp_path)


def test_large_tiles_are_cut_to_a_random_window_before_the_transform(tmp_path):
    """A 300 x 400 tile with tile_window 128: the transform sees a 128 x 128 region of image and mask together
    (the mask stays the thresholded image), a different region per epoch, the same for the same key."""
    h, w = 300, 400
    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    Image.fromarray(img).save(tmp_path / "images" / "t.png")
    Image.fromarray((img[..., 0] > 127).astype(np.uint8)).save(tmp_path / "masks" / "t.png")
    split = scan_pairs(PairingRule(tmp_path), "train", 0.5, val_fraction=0.01)
    seen = []
    ds = SegmentationDataset(split, lambda i, m: (seen.append(tuple(i.shape)), (i, m))[1], 2, window=128)
    a, mask, _ = ds[(0, 0)]
    assert seen == [(3, 128, 128)] and tuple(mask.shape) == (128, 128)
    assert torch.equal((a[0] > 127).long(), mask.as_subclass(torch.Tensor))  # same region of both
    b, _, _ = ds[(1, 0)]
    assert not torch.equal(a, b) and torch.equal(a, ds[(0, 0)][0])  # per-epoch region, reproducible
    whole = SegmentationDataset(split, lambda i, m: (i, m), 2)[(0, 0)][0]
    assert tuple(whole.shape) == (3, h, w)  # window 0: the whole tile
