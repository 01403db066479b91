"""Bad-input table, data side: unusual image files and folder layouts -> exit status -> message -> what survived.

Rows run ``python -m trainer`` on tiny folders built in ``tmp`` (8x8 PNGs, resnet18 at 32 px, CPU). The plain
tests below the table cover what a row cannot express: inputs that are now handled (16-bit PNGs convert,
symlink loops are not followed, bad val files are left out, consecutive bad files are counted once), the
writer's watchdog, and the fixed-input-size check.
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from bad_input_table import REPO, Case, run_case, trainer_cmd
from conftest import tiny_overrides
from PIL import Image

from tests import forkserver
from trainer.config import ConfigError, load_config
from trainer.data.formats.image_decode import MAX_IMAGE_PIXELS, ImageTooLargeError, decode_file, to_uint8
from trainer.data.formats.imagefolder import BadSample, DataError, ImageFolderDataset, check_split, scan_split
from trainer.engine.distributed import DistInfo

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


# --- files -----------------------------------------------------------------------------------------------
def _pixels(seed: int, size: int = 8) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (size, size, 3)).astype(np.uint8)


def _png8(path: Path, seed: int) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    a = _pixels(seed)
    Image.fromarray(a).save(path)
    return a


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png16(path: Path, rgb16: np.ndarray) -> None:
    """A 16-bit-per-channel RGB PNG (PIL cannot write one)."""
    h, w, _ = rgb16.shape
    raw = b"".join(b"\x00" + rgb16[y].astype(">u2").tobytes() for y in range(h))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
        + _png_chunk(b"IDAT", zlib.compress(raw))
        + _png_chunk(b"IEND", b"")
    )


def _png_bomb(path: Path, w: int = 65000, h: int = 65000) -> None:
    """A valid 8x8 PNG whose IHDR claims w x h pixels (CRC recomputed): a few hundred bytes."""
    _png8(path, 0)
    data = bytearray(path.read_bytes())
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", w, h)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    path.write_bytes(bytes(data))


def _jpeg_bomb(path: Path) -> None:
    """A valid 8x8 JPEG whose SOF0 header claims 65,000 x 65,000 pixels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_pixels(1)).save(path, quality=90)
    data = bytearray(path.read_bytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 65000, 65000)  # height, width
    path.write_bytes(bytes(data))


def _folder(root: Path, per_class: int = 4, classes=("a", "b"), val_per_class: int | None = None) -> Path:
    for split, n in (("train", per_class), ("val", val_per_class or per_class)):
        for ci, c in enumerate(classes):
            for i in range(n):
                _png8(root / split / c / f"{i:03d}.png", 1000 * ci + i + (0 if split == "train" else 500))
    return root


def _train_argv(data, tmp: Path, *extra: str) -> list[str]:
    return trainer_cmd(
        "train",
        "--data-dir",
        str(data),
        "--model",
        "resnet18",
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--num-workers",
        "0",
        "--device",
        "cpu",
        "--epochs",
        "1",
        "--max-steps-per-epoch",
        "2",
        "--checkpoint-dir",
        str(tmp / "ck"),
        "--log-dir",
        str(tmp / "logs"),
        *extra,
    )


def _nothing_trained(tmp: Path) -> None:
    ck = tmp / "ck"
    assert not ck.exists() or not [p for p in ck.iterdir() if p.name.startswith("ckpt-")]


# --- rows ------------------------------------------------------------------------------------------------
def _setup_data_dir_file(tmp):
    (tmp / "data.tar").write_bytes(b"not a folder")
    return _train_argv(tmp / "data.tar", tmp)


def _setup_data_dir_missing(tmp):
    return _train_argv(tmp / "nowhere", tmp)


def _setup_vit_32(tmp):  # data_dir missing too: the model check runs before the data scan
    return _train_argv(tmp / "nowhere", tmp, "--model", "vit_b_16")


def _setup_unknown_model(tmp):
    return _train_argv(tmp / "nowhere", tmp, "--model", "resnet_fifty")


def _setup_one_class(tmp):
    return _train_argv(_folder(tmp / "d", classes=("only",)), tmp)


def _setup_val_bad_files(tmp):
    d = _folder(tmp / "d")
    _png_bomb(d / "val" / "a" / "bomb.png")
    (d / "val" / "b" / "empty.jpg").write_bytes(b"")
    return _train_argv(d, tmp)


def _setup_train_bomb(tmp):  # 16 files, 2 steps of 8: every file is read
    d = _folder(tmp / "d", per_class=8)
    (d / "train" / "b" / "000.png").unlink()
    _jpeg_bomb(d / "train" / "b" / "bomb.jpg")
    return _train_argv(d, tmp)


def _setup_ffcv_bomb(tmp):
    d = _folder(tmp / "d")
    _png_bomb(d / "train" / "a" / "bomb.png")
    return trainer_cmd(
        "write-ffcv", "--data-dir", str(d), "--ffcv-dir", str(tmp / "out"), "--num-workers", "2", "--splits", "train"
    )


def _ffcv_nothing_left(tmp):
    assert not (tmp / "out").exists(), list((tmp / "out").iterdir())  # no .partial, no bad-file log, no folder


CASES = [
    Case("data-dir-is-a-file", _setup_data_dir_file, 2, "data.tar is a file, not a folder", _nothing_trained),
    Case("data-dir-missing", _setup_data_dir_missing, 2, "data_dir", _nothing_trained),
    Case(
        "fixed-size-model-too-small",
        _setup_vit_32,
        2,
        "model: vit_b_16 cannot take 32x32 images (image_size=32)",
        _nothing_trained,
    ),
    Case(
        "unknown-model-before-data-scan",
        _setup_unknown_model,
        2,
        "model: unknown classification model",
        _nothing_trained,
    ),
    Case("one-class-dataset", _setup_one_class, 2, "has 1 class; classification needs >= 2", _nothing_trained),
    Case(
        "val-bad-files-over-fraction",
        _setup_val_bad_files,
        2,
        "data split 'val': 2 of 10 files cannot be read",
        _nothing_trained,
    ),
    Case("train-jpeg-over-pixel-limit", _setup_train_bomb, 2, "bomb.jpg (ImageTooLargeError", _nothing_trained),
    Case(
        "write-ffcv-png-over-pixel-limit",
        _setup_ffcv_bomb,
        2,
        "bomb.png (ImageTooLargeError",
        _ffcv_nothing_left,
        timeout=300,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path):
    proc = run_case(case, tmp_path)
    if case.id == "data-dir-missing":
        assert "does not exist" in proc.stderr.splitlines()[-1]


# --- 16-bit PNGs -----------------------------------------------------------------------------------------
def test_16bit_png_decodes_like_its_8bit_version(tmp_path):
    a8 = _pixels(3, 16)
    a16 = a8.astype(np.uint16) * 256 + np.random.RandomState(4).randint(0, 256, a8.shape).astype(np.uint16)
    _png16(tmp_path / "x16.png", a16)
    Image.fromarray(a8).save(tmp_path / "x8.png")
    x8, x16 = decode_file(str(tmp_path / "x8.png")), decode_file(str(tmp_path / "x16.png"))
    assert x16.dtype == torch.uint8 and x16.shape == x8.shape == (3, 16, 16)
    assert (x16.int() - x8.int()).abs().max() <= 1  # scaled (>> 8), not clipped at 255
    grey16 = a8[..., 0].astype(np.uint16) * 257  # PIL: mode I;16 (PNG through torchvision, TIFF through PIL)
    for name in ("g16.png", "g16.tif"):
        Image.fromarray(grey16).save(tmp_path / name)
        g = decode_file(str(tmp_path / name))
        assert g.dtype == torch.uint8 and torch.equal(g[0], torch.from_numpy(a8[..., 0])) and torch.equal(g[0], g[2])
    Image.fromarray(a8[..., 0].astype(np.float32) / 255).save(tmp_path / "f.tif")  # PIL mode F, [0, 1]
    assert (decode_file(str(tmp_path / "f.tif"))[0].int() - torch.from_numpy(a8[..., 0]).int()).abs().max() <= 1


def test_to_uint8_scales_every_dtype():
    assert torch.equal(
        to_uint8(torch.tensor([0, 255, 256, 65535], dtype=torch.uint16)),
        torch.tensor([0, 0, 1, 255], dtype=torch.uint8),
    )
    assert torch.equal(to_uint8(torch.tensor([-1.0, 0.0, 1.0, 2.0])), torch.tensor([0, 0, 255, 255], dtype=torch.uint8))
    assert to_uint8(torch.tensor([2**31 - 1, -5], dtype=torch.int32)).tolist() == [255, 0]


def test_mixed_8_and_16_bit_folder_trains(tmp_path):
    from trainer.engine.trainer import Trainer

    d = _folder(tmp_path / "d", per_class=8)
    for split in ("train", "val"):
        for c in ("a", "b"):
            _png16(d / split / c / "zz16.png", _pixels(7).astype(np.uint16) * 257)
    t = Trainer(load_config(None, tiny_overrides(d, tmp_path, batch_size=6, epochs=1, lr=0.01)), CPU)
    last = t.fit()
    t.close()
    assert last["bad_files"] == 0 and last["val_bad_files"] == 0 and np.isfinite(last["train_loss"])


def test_write_ffcv_16bit_png_is_converted_and_never_hangs(tmp_path):
    """Once a hang (FFCV's worker raised on uint16, its parent waited forever): now 8-bit raw pixels."""
    a8 = _pixels(5)
    d = _folder(tmp_path / "d", per_class=2)
    _png16(d / "train" / "a" / "000.png", a8.astype(np.uint16) * 257)  # replaces an 8-bit file
    cmd = trainer_cmd(
        "write-ffcv",
        "--data-dir",
        str(d),
        "--ffcv-dir",
        str(tmp_path / "out"),
        "--num-workers",
        "2",
        "--splits",
        "train",
        "--write-mode",
        "raw",
    )
    p = forkserver.run(cmd, cwd=tmp_path, env={**_env()}, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert sorted(x.name for x in (tmp_path / "out").iterdir()) == ["train.ffcv", "train.json"]
    from ffcv.reader import Reader

    path = tmp_path / "out" / "train.ffcv"
    meta = Reader(str(path)).metadata["f0"][0]  # sample 0 = train/a/000.png (scan order)
    assert (meta["height"], meta["width"]) == (8, 8)
    raw = np.fromfile(path, dtype=np.uint8, count=8 * 8 * 3, offset=int(meta["data_ptr"])).reshape(8, 8, 3)
    assert np.array_equal(raw, a8)


def test_page_size_fits_the_largest_sample():
    from trainer.data.formats.ffcv_writer import _page_size

    assert _page_size(500) == 8 << 20  # FFCV's default
    for r in (1000, 1500, 2000, 4000):  # a raw 2000 px sample (12 MB) once made FFCV's worker raise, then hang
        assert _page_size(r) >= 2 * 3 * r * r and _page_size(r) & (_page_size(r) - 1) == 0


_RAISING_WRITER = """
import sys, numpy as np
from trainer.data.formats.ffcv import require_ffcv
require_ffcv()
from ffcv.fields import IntField, RGBImageField
from trainer.data.formats.ffcv_writer import WriterFailed, _watched_writer

class Raises:
    def __len__(self):
        return 40
    def __getitem__(self, i):
        if i == 17:
            raise ValueError("simulated encoder failure")
        return np.zeros((8, 8, 3), np.uint8), 0

try:
    _watched_writer()(sys.argv[1], {"image": RGBImageField(), "label": IntField()},
                      num_workers=2).from_indexed_dataset(Raises(), chunksize=5)
except WriterFailed as e:
    print("failed:", e)
"""


def test_writer_worker_failure_ends_instead_of_hanging(tmp_path):
    p = forkserver.run(
        [sys.executable, "-c", _RAISING_WRITER, str(tmp_path / "x.ffcv")],
        cwd=REPO,
        env=_env(),
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "failed: a writer process failed after" in p.stdout and "simulated encoder failure" in p.stdout, p.stdout
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


# --- pixel limit -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("maker", [_png_bomb, _jpeg_bomb], ids=["png", "jpeg"])
def test_header_over_pixel_limit_is_a_bad_file(tmp_path, maker):
    bomb = tmp_path / "train" / "a" / ("bomb.png" if maker is _png_bomb else "bomb.jpg")
    maker(bomb)
    assert bomb.stat().st_size < 2000
    with pytest.raises(ImageTooLargeError, match="MAX_IMAGE_PIXELS=89,478,485"):
        decode_file(str(bomb))
    _png8(tmp_path / "train" / "a" / "good.png", 1)
    ds = ImageFolderDataset(scan_split(tmp_path, "train"), lambda e: (lambda x: x))
    img, _, bad = ds[(0, 0)]
    assert img.shape == (3, 8, 8) and [b.path for b in bad] == [str(bomb)] and "ImageTooLargeError" in bad[0].error


def test_pixel_limit_is_pils_default_and_just_over_it_is_refused(tmp_path):
    from PIL import Image as PILImage

    assert MAX_IMAGE_PIXELS == 89_478_485 == PILImage.MAX_IMAGE_PIXELS
    _png_bomb(tmp_path / "b.png", w=MAX_IMAGE_PIXELS // 8000 + 1, h=8000)  # between PIL's warning and its error
    with pytest.raises(ImageTooLargeError, match=r"header says 11185x8000"):
        decode_file(str(tmp_path / "b.png"))


# --- val files checked up front --------------------------------------------------------------------------
def test_bad_val_files_are_named_and_left_out(tmp_path):
    from trainer.tasks.classification.task import ClassificationTask

    d = _folder(tmp_path / "d", per_class=4, val_per_class=10)
    (d / "val" / "a" / "garbage.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg" * 10)
    good = (d / "val" / "b" / "000.png").read_bytes()
    (d / "val" / "b" / "truncated.png").write_bytes(good[: len(good) // 2])  # header fine, pixels cut
    cfg = load_config(None, tiny_overrides(d, tmp_path, max_bad_fraction=0.2))
    data = ClassificationTask(cfg, CPU).build_data()
    assert len(data.val) == 20 and len(data.train) == 8
    line = next(x for x in data.report if "cannot be read" in x)
    assert "data: val: 2 of 22 file(s) cannot be read" in line and "garbage.jpg" in line and "truncated.png" in line
    assert all(not p.endswith(("garbage.jpg", "truncated.png")) for p, _ in data.val.samples)
    assert data.label_space == {"classes": ["a", "b"]}
    cfg = load_config(None, tiny_overrides(d, tmp_path, max_bad_fraction=0.05))
    with pytest.raises(DataError, match=r"data split 'val': 2 of 22 files cannot be read.*garbage.jpg"):
        ClassificationTask(cfg, CPU).build_data()


def test_header_only_check_for_large_splits(tmp_path):
    d = _folder(tmp_path / "d", per_class=3)
    _png_bomb(d / "val" / "a" / "bomb.png")
    (d / "val" / "a" / "empty.png").write_bytes(b"")
    good = (d / "val" / "b" / "000.png").read_bytes()
    (d / "val" / "b" / "truncated.png").write_bytes(good[: len(good) // 2])
    scan = scan_split(d, "val")
    kept, report = check_split(scan, 0.5, full=False)  # what a split over FULL_CHECK_MAX_FILES gets
    assert len(kept.samples) == len(scan.samples) - 2 and "headers read" in report[0]
    assert "bomb.png" in report[0] and "empty.png" in report[0]  # a truncated body needs the full decode
    kept, report = check_split(scan, 0.5, full=True)
    assert len(kept.samples) == len(scan.samples) - 3 and "truncated.png" in report[0]


# --- symlinks ----------------------------------------------------------------------------------------------
def test_symlink_loop_in_class_folder_is_not_followed(tmp_path):
    d = _folder(tmp_path / "d", per_class=8, classes=("ants", "bees"))
    (d / "train" / "ants" / "loop").symlink_to("..")  # train/ants/loop -> train/
    scan = scan_split(d, "train")
    assert len(scan.samples) == 16
    bees = scan.classes.index("bees")
    assert all(label == bees for p, label in scan.samples if "/bees/" in p)
    assert "not followed: 1 folder symlink(s)" in scan.census() and "loop -> .." in scan.census()


def test_symlinked_class_folders_and_files_still_work(tmp_path):
    real = _folder(tmp_path / "real", per_class=3)
    d = tmp_path / "linked" / "train"
    d.mkdir(parents=True)
    (d / "a").symlink_to(real / "train" / "a", target_is_directory=True)  # a dataset assembled from links
    (d / "b").mkdir()
    for f in (real / "train" / "b").iterdir():
        (d / "b" / f.name).symlink_to(f)
    scan = scan_split(tmp_path / "linked", "train")
    assert scan.classes == ["a", "b"] and len(scan.samples) == 6 and not scan.links
    assert decode_file(scan.samples[-1][0]).shape == (3, 8, 8)


def test_data_dir_layout_messages(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(DataError, match=r"data split 'train': data_dir .*/f is a file, not a folder"):
        scan_split(tmp_path / "f", "train")
    with pytest.raises(DataError, match=r"data split 'train': data_dir .*/none does not exist"):
        scan_split(tmp_path / "none", "train")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train").write_text("x")
    with pytest.raises(DataError, match=r"folder .*/d/train is a file, not a folder"):
        scan_split(tmp_path / "d", "train")


# --- bad-file counting -----------------------------------------------------------------------------------
def test_consecutive_bad_training_files_are_counted_once(tmp_path):
    """24 files, 5 bad (3 in a row, one alone, one last that wraps to index 0): a full epoch counts 5.

    Counting the files passed over while looking for a replacement gave 3 + 2 + 1 + 1 + 1 = 8 (33 %), over
    max_bad_fraction=0.25, though only 21 % are bad."""
    from trainer.engine.trainer import Trainer

    d = _folder(tmp_path / "d", per_class=12)
    bad = [d / "train" / c / f"{i:03d}.png" for c, i in (("a", 3), ("a", 4), ("a", 5), ("b", 7), ("b", 11))]
    for b in bad:
        b.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    cfg = load_config(None, tiny_overrides(d, tmp_path, batch_size=8, epochs=1, lr=0.01, max_bad_fraction=0.25))
    t = Trainer(cfg, CPU)
    assert t.steps_per_epoch * 8 == 24  # every index visited once
    last = t.fit()
    t.close()
    assert last["bad_files"] == len(bad)


def test_dataset_reports_only_its_own_bad_file(tmp_path):
    d = _folder(tmp_path / "d", per_class=4)
    for i in (1, 2):
        (d / "train" / "a" / f"{i:03d}.png").write_bytes(b"")
    ds = ImageFolderDataset(scan_split(d, "train"), lambda e: (lambda x: x))
    reports = [ds[(0, i)][2] for i in range(len(ds))]
    assert [len(r) for r in reports] == [0, 1, 1, 0, 0, 0, 0, 0]
    assert all(isinstance(b, BadSample) for r in reports for b in r)
    assert torch.equal(ds[(0, 1)][0], ds[(0, 3)][0])  # index 1 replaced by the next good file, index 3


# --- fixed-input-size models -----------------------------------------------------------------------------
def test_model_input_size_checked_on_meta(tmp_path):
    from trainer.tasks.classification.task import ClassificationTask

    def check(**kw):
        cfg = load_config(None, tiny_overrides(tmp_path / "unused", tmp_path, **kw))
        ClassificationTask(cfg, CPU).check_config()

    check(model="vit_b_16", image_size=224)
    check(model="resnet50", image_size=224)
    with pytest.raises(ConfigError, match=r"model: vit_b_16 cannot take 32x32 images \(image_size=32\).*Expected 224"):
        check(model="vit_b_16", image_size=32)
    with pytest.raises(
        ConfigError,
        match=r"vit_b_16 cannot take 160x160 images \(progressive resizing in epoch 1: "
        r"progressive_min_size=160, image_size=224\)",
    ):
        check(model="vit_b_16", image_size=224, progressive_resize=True, progressive_min_size=160, epochs=3)
    with pytest.raises(ConfigError, match=r"model: alexnet cannot take 16x16 images"):
        check(model="alexnet", image_size=16)
    with pytest.raises(ConfigError, match="model: unknown classification model 'resnet_fifty'"):
        check(model="resnet_fifty")
    check(model="regnet_y_400mf", image_size=224)  # not buildable on meta: not checked, no error
