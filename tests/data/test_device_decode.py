"""``decode_device="cuda"``: workers read JPEG bytes and draw the crops, the device decodes the batch.

The device path is device-generic: run with device=cpu it must give exactly (torch.equal) the uint8 batch
of the worker path for the same (seed, epoch, indices), on real JPEGs from the shared datasets; the GPU test
compares nvJPEG's output with the CPU decode within a tolerance.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from trainer.data.formats.device_jpeg import EncodedJpeg, collate_encoded, decode_on_device, jpeg_list
from trainer.data.formats.imagefolder import ImageFolderDataset, collate_skip_bad, scan_split
from trainer.data.sampler import EpochSampler
from trainer.data.transforms import train_transform, val_transform

CPU = torch.device("cpu")


def _tt(epoch):
    return train_transform(96 if epoch < 2 else 128, 0.08, 0.5)


def _vt(epoch):
    return val_transform(112, 0.875)


def _both(scan, transform, seed=7, replace_bad=True):
    kw = dict(seed=seed, replace_bad=replace_bad)
    return ImageFolderDataset(scan, transform, **kw), ImageFolderDataset(scan, transform, decode_device="cuda", **kw)


def _keys(n: int, epoch: int, count: int, seed: int = 7) -> list[tuple[int, int]]:
    sampler = EpochSampler(n, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    keys = list(sampler)[:count]
    assert all(k[0] == epoch for k in keys)
    return keys


def _compare(cpu_ds, cuda_ds, keys, eval_transform=None, replace_bad=True):
    """Worker-path batch vs device-path batch (device=cpu) for the same keys; returns the encoded batch."""
    state = torch.default_generator.get_state()
    want = collate_skip_bad([cpu_ds[k] for k in keys])
    encoded = collate_encoded([cuda_ds[k] for k in keys])
    assert torch.equal(torch.default_generator.get_state(), state)  # workers' global RNG left as it was
    images, labels, failed = decode_on_device(encoded, CPU, eval_transform, replace_bad=replace_bad)
    assert failed == []
    assert images.dtype == torch.uint8 and images.shape == want["image"].shape
    assert torch.equal(labels, want["label"])
    assert torch.equal(images, want["image"])
    assert [(b.path, b.error) for b in encoded["bad"]] == [(b.path, b.error) for b in want["bad"]]
    return encoded


def test_device_path_on_cpu_equals_worker_path_on_real_jpegs(shared_data):
    scan = scan_split(shared_data / "hymenoptera", "train")
    cpu_ds, cuda_ds = _both(scan, _tt)
    gif = next(i for i, (p, _) in enumerate(scan.samples) if p.endswith(".gif"))
    for epoch in (0, 3):  # two training sizes (96, 128): the crop carries the epoch's output size
        keys = _keys(len(scan.samples), epoch, 40) + [(epoch, gif)]
        enc = _compare(cpu_ds, cuda_ds, keys)
        files = jpeg_list(enc)
        assert len(files) == 40 and enc["decoded_pos"].tolist() == [40]  # the GIF: worker decode
        assert enc["crop"].shape == (40, 7) and enc["jpeg"].dtype == torch.uint8 and enc["jpeg"].ndim == 1
        assert bytes(files[0][:3].numpy()) == b"\xff\xd8\xff" and bytes(files[-1][-2:].numpy()) == b"\xff\xd9"

    nette = scan_split(shared_data / "imagenette-subset", "val")
    cpu_ds, cuda_ds = _both(nette, _vt, replace_bad=False)
    enc = _compare(cpu_ds, cuda_ds, _keys(len(nette.samples), 0, 24), eval_transform=_vt(0), replace_bad=False)
    assert enc["crop"] is None and len(jpeg_list(enc)) == 24


def test_encoded_batches_cross_a_worker_process(shared_data):
    """One worker, batches of 64 encoded files: a list of 64 tensors per batch once hung the loader (each
    tensor's storage is its own shared-memory descriptor); the concatenated bytes travel as one tensor."""
    from torch.utils.data import BatchSampler, DataLoader

    scan = scan_split(shared_data / "imagenette-subset", "train")
    ds = ImageFolderDataset(scan, _tt, decode_device="cuda")
    sampler = BatchSampler(EpochSampler(len(ds), shuffle=True, seed=0), 64, drop_last=True)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=1, collate_fn=collate_encoded, timeout=120)
    for i, batch in enumerate(loader):
        images, labels, _ = decode_on_device(batch, CPU)
        assert images.shape == (64, 3, 96, 96) and labels.shape == (64,)
        if i == 5:
            break


def _copy_photos(src: Path, dst: Path, n: int = 3) -> list[Path]:
    out = []
    for cls in ("ants", "bees"):
        (dst / "train" / cls).mkdir(parents=True)
        for f in sorted((src / "train" / cls).glob("*.jpg"))[:n]:
            out.append(Path(shutil.copy(f, dst / "train" / cls / f.name)))
    return out


def test_png_cmyk_and_bad_files_fall_back_to_the_worker_and_still_match(shared_data, tmp_path):
    photos = _copy_photos(shared_data / "hymenoptera", tmp_path / "d")
    rgb = Image.open(photos[0]).convert("RGB")
    rgb.save(photos[0].with_name("zz_png_named_jpg.jpg"), format="PNG")  # content-sniffed, not by name
    rgb.save(photos[0].with_name("zz_real.png"))
    rgb.convert("CMYK").save(photos[0].with_name("zz_cmyk.jpg"), quality=90)
    rgb.convert("L").save(photos[0].with_name("zz_grey.jpg"), quality=90)  # device path, read as RGB
    good = photos[-1].read_bytes()
    photos[-1].with_name("zz_truncated.jpg").write_bytes(good[: len(good) // 3])  # no EOI: worker decides
    photos[-1].with_name("zz_garbage.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg " * 20 + b"\xff\xd9")
    scan = scan_split(tmp_path / "d", "train")
    names = [Path(p).name for p, _ in scan.samples]
    keys = [(2, i) for i in range(len(scan.samples))]

    cpu_ds, cuda_ds = _both(scan, _tt)
    enc = _compare(cpu_ds, cuda_ds, keys)
    on_worker = {names[i] for i in enc["decoded_pos"].tolist()}
    assert {"zz_png_named_jpg.jpg", "zz_real.png", "zz_cmyk.jpg"} <= on_worker
    assert "zz_grey.jpg" not in on_worker  # greyscale JPEG: decoded on the device with ImageReadMode.RGB
    assert sorted(Path(b.path).name for b in enc["bad"]) == ["zz_garbage.jpg", "zz_truncated.jpg"]

    cpu_ds, cuda_ds = _both(scan, _vt, replace_bad=False)  # evaluation: bad files dropped, as today
    enc = _compare(cpu_ds, cuda_ds, keys, eval_transform=_vt(0), replace_bad=False)
    assert len(enc["label"]) == len(keys) - 2


def test_a_jpeg_no_decoder_reads_is_replaced_in_training_and_dropped_in_evaluation(shared_data):
    good = ImageFolderDataset(scan_split(shared_data / "hymenoptera", "val"), _tt, decode_device="cuda")[(0, 0)]
    broken = EncodedJpeg(
        "broken.jpg",
        torch.frombuffer(bytearray(b"\xff\xd8\xff\xe0xx" * 9 + b"\xff\xd9"), dtype=torch.uint8),
        5,
        5,
        good[0].crop,
    )
    batch = collate_encoded([(broken, 0, ()), good])
    with pytest.warns(UserWarning, match="broken.jpg"):
        images, labels, failed = decode_on_device(batch, CPU)
    assert [b.path for b in failed] == ["broken.jpg"] and torch.equal(images[0], images[1]) and len(labels) == 2
    with pytest.warns(UserWarning):
        images, labels, _ = decode_on_device(batch, CPU, replace_bad=False)
    assert images.shape[0] == 1 and labels.tolist() == [good[1]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvjpeg_batch_close_to_the_cpu_decode(shared_data):
    scan = scan_split(shared_data / "hymenoptera", "train")
    cpu_ds, cuda_ds = _both(scan, _tt)
    keys = _keys(len(scan.samples), 1, 64)
    want = collate_skip_bad([cpu_ds[k] for k in keys])["image"]
    got, labels, failed = decode_on_device(collate_encoded([cuda_ds[k] for k in keys]), torch.device("cuda"))
    assert failed == [] and got.device.type == "cuda" and got.shape == want.shape
    diff = (got.cpu().int() - want.int()).abs()
    # nvJPEG's IDCT/upsampling differ from libjpeg-turbo's by a few levels; the crops must be the same.
    assert diff.float().mean() < 2.0 and (diff > 16).float().mean() < 0.01, (diff.float().mean(), diff.max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvjpeg_never_writes_into_memory_the_training_stream_still_reads(shared_data):
    """The allocator race of torchvision's nvJPEG decoder (outputs allocated on the current stream, written from
    a private one): tensors with known values are freed while reductions that read them wait behind a long
    kernel on the training stream; a decode then runs. Every reduction must still see its own values, and the
    decoded images must equal a decode done with the GPU idle."""
    from trainer.data.formats.device_jpeg import _decode_jpegs

    files = sorted((shared_data / "imagenette-subset" / "train").glob("*/*"))[:64]
    data = [torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in files]
    dev = torch.device("cuda")
    reference, failed = _decode_jpegs(data, [str(f) for f in files], dev)
    torch.cuda.synchronize()
    assert failed == []
    reference = [r.cpu() for r in reference]
    for trial in range(10):
        blocks = [torch.full((3, 224, 224), float(i + trial), device=dev) for i in range(64)]
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time queued before the reductions
        sums = [b.sum() for b in blocks]
        del blocks  # freed while the reductions that read them are still queued
        images, _ = _decode_jpegs(data, [str(f) for f in files], dev)
        torch.cuda.synchronize()
        expected = [float(i + trial) * 3 * 224 * 224 for i in range(64)]
        assert [s.item() for s in sums] == expected, f"trial {trial}: a reduction read memory the decode wrote"
        assert all(torch.equal(a.cpu(), b) for a, b in zip(images, reference)), f"trial {trial}"


def test_decode_jpegs_on_cpu_takes_no_stream(shared_data):
    """On the CPU the decode runs as it is (no CUDA stream is made or asked for)."""
    from trainer.data.formats import device_jpeg

    files = sorted((shared_data / "imagenette-subset" / "val").glob("*/*"))[:4]
    data = [torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in files]
    before = dict(device_jpeg._DECODE_STREAMS)  # a GPU test of the same process may have made one for cuda:0
    images, failed = device_jpeg._decode_jpegs(data, [str(f) for f in files], CPU)
    assert failed == [] and len(images) == 4 and all(i.dtype == torch.uint8 and i.shape[0] == 3 for i in images)
    assert device_jpeg._DECODE_STREAMS == before
