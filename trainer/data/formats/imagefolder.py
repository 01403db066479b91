"""ImageFolder datasets with a fast uint8 decode path, bad-file skipping and a format census.

Layout: ``root/<split>/<class>/<file>``; class index = position of the class folder in sorted order (as in
``torchvision.datasets.ImageFolder``). Unlike torchvision's ImageFolder this one

* decodes with ``torchvision.io.decode_image`` (libjpeg-turbo / libpng / giflib, content-sniffed, so a PNG
  named ``.jpg`` still decodes) and falls back to PIL for BMP/TIFF/PPM; GIF is accepted (torchvision skips it);
  16-bit and float images are scaled to 8 bits; a header that claims more than
  :data:`~trainer.data.formats.image_decode.MAX_IMAGE_PIXELS` pixels is refused before anything is decoded
  (:func:`~trainer.data.formats.image_decode.decode_file`);
* follows symlinked class folders and symlinked files, but not folder symlinks inside a class folder (a
  link back to a parent would repeat files and give them the wrong class); they are listed in the census;
* keeps images as uint8 CHW tensors through crop/flip/resize; conversion to float and normalisation happen
  once per batch on the training device (FFCV-style), which cuts worker CPU time and IPC bytes by 4x;
* never raises on a corrupt file: ``__getitem__`` returns a :class:`BadSample` that :func:`collate_skip_bad`
  drops and reports, so the loop can count bad files per epoch and abort above a threshold;
* takes ``(epoch, index)`` keys from :class:`trainer.data.sampler.EpochSampler`; the augmentation RNG is
  seeded from ``(seed, epoch, index)`` so every sample's crop and flip are a pure function of those three
  numbers, independent of worker count and of interruptions;
* can leave the JPEG decode to the training device (``decode_device="cuda"``): workers read the bytes and the
  header, draw the same crop from the same seeded stream, and
  :func:`~trainer.data.formats.device_jpeg.decode_on_device` decodes the batch there
  (:func:`~trainer.data.formats.device_jpeg.collate_encoded` documents the batch; the whole path is in
  :mod:`trainer.data.formats.device_jpeg`).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from torch.utils.data import Dataset

from trainer.config.schema import DECODE_DEVICES
from trainer.data.formats.columns import LabelledPaths
from trainer.data.formats.device_jpeg import EncodedJpeg, read_jpeg_for_device
from trainer.data.formats.image_decode import check_header, decode_file
from trainer.data.samples import (  # noqa: F401 - BadSample, collate_skip_bad, sample_seed re-exported
    BadSample,
    collate_skip_bad,
    decode_or_replace,
    describe_error,
    sample_seed,
    seeded_for_sample,
)
from trainer.data.transforms import draw_train_crop
from trainer.errors import DataError

#: Extensions scanned (lower-case). torchvision.io decodes JPEG/PNG/GIF/WEBP; PIL handles the rest.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".ppm", ".pgm")

#: :func:`check_files` decodes splits of up to this many files in full (finds truncated files too; 1-3 ms
#: per 224 px JPEG on a 2-vCPU machine, so at most a few seconds); larger splits get the header-only check.
FULL_CHECK_MAX_FILES = 1000


@dataclass
class SplitScan:
    """Result of scanning one split: ``samples`` [(path, class_index)] (a list of pairs is packed into flat
    :class:`~trainer.data.formats.columns.LabelledPaths`: loader workers do not grow over an epoch; reads like
    the list), ``classes`` (sorted folder names),
    ``formats`` (extension -> file count), ``ignored`` (files without an image extension) and ``links``
    (folder symlinks inside class folders, not followed)."""

    root: Path
    classes: list[str]
    samples: LabelledPaths
    formats: dict[str, int]
    ignored: list[str]
    links: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.samples, LabelledPaths):  # a list of pairs: packed flat (no object per file)
            self.samples = LabelledPaths(self.samples)

    def census(self) -> str:
        """One line for the log, e.g. ``245 files in 2 classes: 243 .jpg, 1 .jpeg, 1 .gif``."""
        fmts = ", ".join(f"{n} {ext}" for ext, n in sorted(self.formats.items(), key=lambda kv: -kv[1]))
        line = f"{len(self.samples)} files in {len(self.classes)} classes: {fmts}"
        if self.ignored:
            line += f"; ignored {len(self.ignored)} non-image file(s) (e.g. {self.ignored[0]})"
        if self.links:
            line += (
                f"; not followed: {len(self.links)} folder symlink(s) inside class folders "
                f"(e.g. {self.links[0]} -> {os.readlink(self.links[0])})"
            )
        return line


def scan_split(root: str | Path, split: str) -> SplitScan:
    """List the image files of ``root/split`` by class.

    Class folders may be symlinks (a dataset assembled from links) and so may files; folder symlinks *inside*
    a class folder are not followed (``os.walk(followlinks=False)``): a link to a parent folder would
    repeat every file under the wrong class. They are listed in :attr:`SplitScan.links` and the census.

    Raises:
        DataError: ``root`` does not exist or is a file, the split folder is missing, has no class folders,
            or a class folder holds no image.
    """
    root = Path(root)
    d = root / split
    layout = f"expected a folder {root}/{split}/<class>/<image>"
    if not root.exists():
        raise DataError(f"data split '{split}': data_dir {root} does not exist ({layout})")
    if not root.is_dir():
        raise DataError(f"data split '{split}': data_dir {root} is a file, not a folder ({layout})")
    if not d.is_dir():
        present = sorted(p.name for p in root.iterdir() if p.is_dir())
        what = "is a file, not a folder" if d.exists() else "does not exist"
        raise DataError(
            f"data split '{split}': folder {d} {what}"
            + (
                f" (sub-folders present: {', '.join(present)})"
                if present
                else f" ({root} has no sub-folders; {layout})"
            )
        )
    classes = sorted(e.name for e in os.scandir(d) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(f"data split '{split}': {d} has no class sub-folders (expected {d}/<class>/<image>)")
    samples, formats, ignored, empty, links = [], collections.Counter(), [], [], []
    for ci, cls in enumerate(classes):
        n_before = len(samples)
        for dirpath, dirnames, filenames in os.walk(d / cls, followlinks=False):
            links += [
                os.path.join(dirpath, x)
                for x in sorted(dirnames)
                if not x.startswith(".") and os.path.islink(os.path.join(dirpath, x))
            ]
            dirnames[:] = sorted(
                x for x in dirnames if not x.startswith(".") and not os.path.islink(os.path.join(dirpath, x))
            )
            for fn in sorted(filenames):
                ext = os.path.splitext(fn)[1].lower()
                if ext in IMAGE_EXTENSIONS:
                    samples.append((os.path.join(dirpath, fn), ci))
                    formats[ext] += 1
                elif not fn.startswith("."):
                    ignored.append(os.path.join(dirpath, fn))
        if len(samples) == n_before:
            empty.append(cls)
    if empty:
        raise DataError(
            f"data split '{split}': class folder(s) with no images: "
            f"{', '.join(str(d / c) for c in empty)} (extensions read: {' '.join(IMAGE_EXTENSIONS)})"
            + (f"; folder symlinks inside class folders are not followed ({links[0]})" if links else "")
        )
    return SplitScan(d, classes, samples, dict(formats), ignored, links)


def check_same_classes(train: SplitScan, val: SplitScan) -> None:
    """Raise :class:`DataError` unless both splits have the same class folders (same order = same labels)."""
    if train.classes != val.classes:
        only_t = sorted(set(train.classes) - set(val.classes))
        only_v = sorted(set(val.classes) - set(train.classes))
        raise DataError(
            f"train/val class mismatch between {train.root} and {val.root}: "
            f"only in train: {only_t or '-'}; only in val: {only_v or '-'}"
        )


def _check_one(path: str, full: bool):
    try:
        if full:
            decode_file(path)
        else:
            check_header(path)
        return None
    except Exception as e:  # noqa: BLE001 - any reader error makes the file bad
        return BadSample(path, describe_error(e))


def check_files(paths: list[str], full: bool | None = None, threads: int = 8) -> tuple[list[BadSample], str]:
    """Find the unreadable files among ``paths`` before training: ``(bad files in path order, how)``.

    ``full=True`` decodes every file (:func:`decode_file`: also finds truncated files; 1-3 ms per 224 px
    JPEG); ``full=False`` opens only each header with PIL (finds empty, non-image and corrupt-header files
    and those over :data:`~trainer.data.formats.image_decode.MAX_IMAGE_PIXELS`, not a truncated body;
    0.1-0.15 ms per file from the page cache on a 2-vCPU machine, so 5-8 s for ImageNet's 50,000 val files,
    more on a cold network disk). ``None``: full for up to :data:`FULL_CHECK_MAX_FILES` files. Files are read
    by ``threads`` threads (I/O overlaps).
    Every rank checks the whole split (same result everywhere, no communication).
    """
    if full is None:
        full = len(paths) <= FULL_CHECK_MAX_FILES
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths)))) as pool:
        bad = [b for b in pool.map(lambda p: _check_one(p, full), paths) if b is not None]
    how = f"{'decoded' if full else 'headers read'} in {time.perf_counter() - t0:.1f} s"
    return bad, how


def check_split(scan: SplitScan, max_bad_fraction: float, full: bool | None = None) -> tuple[SplitScan, list[str]]:
    """Check every file of ``scan`` up front (:func:`check_files`) and leave the unreadable ones out.

    Returns ``(scan without the bad files, report lines)``; the lines name the first few bad files and
    their count. Meant for the validation split, so that evaluation never meets a bad file after a whole
    epoch of training.

    Raises:
        DataError: more than ``max_bad_fraction`` of the files (or all of them) are unreadable; names them.
    """
    bad, how = check_files([p for p, _ in scan.samples], full)
    if not bad:
        return scan, []
    n, split = len(scan.samples), scan.root.name
    names = "; ".join(f"{b.path} ({b.error})" for b in bad[:5]) + (f"; (+{len(bad) - 5} more)" if len(bad) > 5 else "")
    if len(bad) > max_bad_fraction * n or len(bad) == n:
        raise DataError(
            f"data split '{split}': {len(bad)} of {n} files cannot be read, more than "
            f"max_bad_fraction={max_bad_fraction}; remove or fix them: {names}"
        )
    dropped = {b.path for b in bad}
    kept = replace(scan, samples=[s for s in scan.samples if s[0] not in dropped])
    return kept, [f"data: {split}: {len(bad)} of {n} file(s) cannot be read ({how}); left out of evaluation: {names}"]


class ImageFolderDataset(Dataset):
    """Map-style dataset over a :class:`SplitScan`.

    Args:
        scan: files and labels of one split.
        transform_for_epoch: ``epoch -> callable(uint8 (3,H,W)) -> uint8 (3,h,w)``; lets progressive
            resizing change the output size by epoch inside long-lived workers.
        seed: base seed of the augmentation RNG.
        replace_bad: training mode: a file that cannot be decoded is skipped and the next decodable file
            (index + 1, + 2, ... up to ``MAX_REPLACEMENTS``) takes its place, so every micro-batch keeps its
            size (static shapes for torch.compile, no empty DDP ranks). Evaluation mode (False): the bad
            file is dropped from its batch, so metrics count each good file exactly once.
        decode_device: ``"cpu"`` (decode in the worker) or ``"cuda"``: JPEGs that
            :func:`read_jpeg_for_device` accepts come back as an :class:`EncodedJpeg` in place of the image,
            carrying the crop drawn from the same seeded stream (:func:`draw_train_crop`; no crop when the
            transform has no random step, i.e. evaluation); other files are decoded and transformed in the
            worker as with ``"cpu"``. Batch them with :func:`~trainer.data.formats.device_jpeg.collate_encoded`,
            decode with :func:`~trainer.data.formats.device_jpeg.decode_on_device`.

    ``__getitem__((epoch, index))`` (or a plain ``index``, taken as epoch 0) returns
    ``(image uint8 (3,h,w) or EncodedJpeg, label int, bad: tuple[BadSample, ...])``, or a :class:`BadSample`
    when ``replace_bad`` is False and the file is bad.

    Bad-file counting: ``bad`` holds only the sample's *own* file, when that file was bad and replaced
    (empty otherwise); the bad files passed over while looking for a replacement are not reported there.
    Every index comes up once in an epoch's permutation, so each bad file is reported exactly once per epoch,
    by its own index, however many bad files sit next to each other (reporting the passed-over files too
    counted a run of n consecutive bad files n(n+1)/2 times). When an epoch is truncated
    (``max_steps_per_epoch``, the incomplete last batch dropped), the count covers the indices actually
    visited, the same files the loop's ``max_bad_fraction`` denominator counts, so the fraction stays an
    unbiased estimate. (The sampler's padding to a multiple of the world size repeats up to
    ``world_size - 1`` indices per epoch; a bad file among them is reported once per repeat.)

    Raises:
        DataError: ``MAX_REPLACEMENTS`` consecutive files are undecodable (names the first one).
    """

    MAX_REPLACEMENTS = 16

    def __init__(
        self,
        scan: SplitScan,
        transform_for_epoch: Callable[[int], Callable],
        seed: int = 0,
        replace_bad: bool = True,
        decode_device: str = "cpu",
    ):
        if decode_device not in DECODE_DEVICES:
            raise ValueError(f"decode_device: got {decode_device!r}; expected one of {', '.join(DECODE_DEVICES)}")
        self.scan = scan
        self.samples = scan.samples
        self.classes = scan.classes
        self.transform_for_epoch = transform_for_epoch
        self.seed = seed
        self.replace_bad = replace_bad
        self.decode_device = decode_device

    def __len__(self) -> int:
        return len(self.samples)

    def _decode(self, index: int):
        """``(uint8 image, label)`` of sample ``index``, or a :class:`BadSample`."""
        path, label = self.samples[index]
        try:
            return decode_file(path), label
        except Exception as e:  # noqa: BLE001 - corrupt, truncated, too large or unsupported: skip, count, report
            return BadSample(path, describe_error(e))

    def _read(self, index: int):
        """``decode_device="cuda"``: ``(EncodedJpeg, label)``, or what :meth:`_decode` gives for a file the
        device decoder does not take (:func:`read_jpeg_for_device`)."""
        path, label = self.samples[index]
        try:
            encoded = read_jpeg_for_device(path)
        except Exception:  # noqa: BLE001 - unreadable: the worker decode reports it as today
            encoded = None
        return (encoded, label) if encoded is not None else self._decode(index)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        load = self._read if self.decode_device != "cpu" else self._decode
        if not self.replace_bad:
            item, own = load(index), ()
            if isinstance(item, BadSample):
                return item
        else:
            item, _, own = decode_or_replace(load, index, len(self.samples), self.MAX_REPLACEMENTS)
        img, label = item
        transform = self.transform_for_epoch(epoch)
        with seeded_for_sample(self.seed, epoch, index):
            if not isinstance(img, EncodedJpeg):
                img = transform(img)
            elif _is_random(transform):
                img = replace(img, crop=draw_train_crop(transform, img.height, img.width))
        return img, label, own


def _is_random(transform) -> bool:
    """Whether ``transform`` (a v2.Compose) draws random numbers, i.e. is a training transform."""
    from torchvision.transforms import v2

    steps = getattr(transform, "transforms", [transform])
    return any(isinstance(t, (v2.RandomResizedCrop, v2.RandomHorizontalFlip)) for t in steps)
