"""The FFCV read path (``--use-ffcv --ffcv-dir DIR``): file checks and the train/val loaders.

Pipelines (ffcv-imagenet's, with normalisation moved to the device as on the ImageFolder path):

* train: :class:`~trainer.data.formats.ffcv_decoder.SeededRandomResizedCropDecoder` (FFCV's random-resized-crop
  decoder, scale ``(crop_scale_min, 1)``, plus the flip, reproducible per (seed, epoch, index)) ->
  ``ToTensor`` -> ``ToDevice`` -> ``ToTorchImage``: uint8 (B, 3, S, S) on the training device, channels_last;
  S follows progressive resizing (the decoder's ``output_size`` changes per epoch, as in ffcv-imagenet);
* val: ``CenterCropRGBImageDecoder((image_size, image_size), ratio=val_resize_ratio)`` -> same tail;
* label: ``IntDecoder`` -> ``ToTensor`` -> ``Squeeze`` -> ``ToDevice``, returned as int64 (B,).

The task normalises (:func:`trainer.data.transforms.normalize_on_device`). Order: FFCV's ``RANDOM``
(``numpy default_rng(seed + epoch)`` in one process; with ``distributed=True`` torch's DistributedSampler
with ``seed`` and ``set_epoch(epoch)``, padded like our EpochSampler) or ``QUASI_RANDOM`` (one process,
``seed * 912300 + epoch``). A mid-epoch resume skips the batches already trained in that epoch
(:class:`FFCVOrder`). Validation reads each rank's ``rank::world`` share through FFCV's ``indices`` (no
padding, so every sample is counted once).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from trainer.config import ConfigError
from trainer.data.formats.imagefolder import DataError
from trainer.data.transforms import train_size_for_epoch

#: What ``--use-ffcv`` needs besides pip packages (libffcv links libturbojpeg and OpenCV via pkg-config).
FFCV_APT_PACKAGES = ("pkg-config", "libturbojpeg0-dev", "libopencv-dev")
FFCV_HINT = (
    "install the ffcv extra: `make ffcv` (as root: apt-get install -y "
    + " ".join(FFCV_APT_PACKAGES)
    + "; then pip install -r requirements-ffcv.txt)"
)


def require_ffcv() -> None:
    """Import ffcv or raise :class:`DataError` saying how to install it (the error ffcv raised included)."""
    threads = torch.get_num_threads()
    try:
        import ffcv.loader  # noqa: F401  (libffcv, numba, OpenCV: the whole import chain)
    except ImportError as e:
        raise DataError(
            f"--use-ffcv / write-ffcv need the ffcv package, which cannot be imported ({e}); " + FFCV_HINT
        ) from None
    finally:
        torch.set_num_threads(threads)  # importing ffcv sets torch's intra-op threads to 1 (Compiler)


def check_beton(path: Path) -> dict:
    """Validate an FFCV file before training: header, field types, sizes; return its facts.

    Returns ``{"samples", "bytes", "labels": int64 array (samples,), "classes": list | None}`` (classes from
    the ``<split>.json`` written beside it, when present).

    Raises:
        DataError: naming ``path`` and what was expected: missing file, shorter than its header or tables,
            another FFCV format version, fields other than (RGBImageField image, IntField label), or a data
            region that points past the end of the file (truncated copy).
    """
    require_ffcv()
    from ffcv.fields import IntField, RGBImageField
    from ffcv.reader import Reader
    from ffcv.types import ALLOC_TABLE_TYPE, CURRENT_VERSION, FieldDescType, HeaderType

    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"FFCV file {path} does not exist (expected <ffcv_dir>/<split>.ffcv from "
            f"`python -m trainer write-ffcv --data-dir DATA --ffcv-dir {path.parent}`)"
        )
    size = path.stat().st_size
    if size < HeaderType.itemsize:
        raise DataError(
            f"FFCV file {path}: {size} bytes, shorter than the {HeaderType.itemsize}-byte header "
            "(truncated or not an FFCV file)"
        )
    header = np.fromfile(path, dtype=HeaderType, count=1)[0]
    if header["version"] != CURRENT_VERSION or not 1 <= header["num_fields"] <= 64:
        raise DataError(
            f"FFCV file {path}: header says format version {header['version']} with "
            f"{header['num_fields']} fields; expected version {CURRENT_VERSION} (ffcv 1.0) and 2 fields "
            "(corrupt header or not an FFCV file)"
        )
    alloc_ptr, n = int(header["alloc_table_ptr"]), int(header["num_samples"])
    if alloc_ptr > size or (size - alloc_ptr) % ALLOC_TABLE_TYPE.itemsize:
        raise DataError(
            f"FFCV file {path}: {size} bytes, but its header announces {n} samples and an "
            f"allocation table at byte {alloc_ptr}; the file is truncated or corrupt (copy or "
            "convert it again)"
        )
    try:
        reader = Reader(str(path))
    except (AssertionError, ValueError, KeyError, IndexError, TypeError, OverflowError, OSError, MemoryError) as e:
        raise DataError(f"FFCV file {path}: unreadable header tables ({type(e).__name__}: {e})") from None
    types = [type(h) for h in reader.handlers.values()]
    if types != [RGBImageField, IntField]:
        raise DataError(
            f"FFCV file {path}: fields {dict(zip(reader.field_names, [t.__name__ for t in types]))}; "
            "expected image: RGBImageField, label: IntField (as write-ffcv writes)"
        )
    tables_end = HeaderType.itemsize + FieldDescType.itemsize * int(header["num_fields"]) + reader.metadata.nbytes
    if len(reader.metadata) != n or alloc_ptr < tables_end or len(reader.alloc_table) < n:
        raise DataError(
            f"FFCV file {path}: {size} bytes, but its header announces {n} samples and an "
            f"allocation table at byte {alloc_ptr}; the file is truncated or corrupt (copy or "
            "convert it again)"
        )
    ends = reader.alloc_table["ptr"] + reader.alloc_table["size"]
    if len(ends) and (int(ends.max()) > alloc_ptr or int(reader.alloc_table["ptr"].min()) < tables_end):
        raise DataError(f"FFCV file {path}: image data points outside the data region (corrupt file)")
    labels = reader.metadata["f1"].astype(np.int64)
    meta = path.with_suffix(".json")
    classes = json.loads(meta.read_text()).get("classes") if meta.is_file() else None
    return {"samples": n, "bytes": size, "labels": labels, "classes": classes}


class BetonSplit:
    """One checked ``.ffcv`` file: ``path``, ``len()`` = samples, ``labels``, ``classes`` (or None)."""

    def __init__(self, path: Path):
        info = check_beton(path)
        self.path, self.bytes, self.labels, self.classes = Path(path), info["bytes"], info["labels"], info["classes"]

    def __len__(self) -> int:
        return len(self.labels)


def open_splits(cfg) -> tuple[BetonSplit, BetonSplit, int, list[str]]:
    """Check ``<ffcv_dir>/<train_split>.ffcv`` and ``<val_split>.ffcv``: (train, val, num_classes, report).

    Raises:
        DataError: the extra is missing, a file is missing/truncated/corrupt, labels are negative, or the
            two files' class lists (``<split>.json``) differ.
    """
    require_ffcv()
    d = Path(cfg.ffcv_dir)
    train, val = BetonSplit(d / f"{cfg.train_split}.ffcv"), BetonSplit(d / f"{cfg.val_split}.ffcv")
    for s in (train, val):
        if len(s) == 0 or s.labels.min() < 0:
            raise DataError(
                f"FFCV file {s.path}: {len(s)} samples, smallest label "
                f"{s.labels.min() if len(s) else '-'}; expected samples with labels >= 0"
            )
    if train.classes is not None and val.classes is not None and train.classes != val.classes:
        raise DataError(
            f"train/val class mismatch between {train.path} and {val.path} "
            f"(their .json files: {len(train.classes)} vs {len(val.classes)} classes)"
        )
    n = len(train.classes) if train.classes else int(max(train.labels.max(), val.labels.max())) + 1
    report = [f"data: ffcv {s.path}: {len(s)} samples, {s.bytes / 1e6:.1f} MB" for s in (train, val)]
    report.append(f"data: ffcv: {n} classes" + ("" if train.classes else " (from the labels; no .json beside)"))
    return train, val, n, report


class FFCVOrder:
    """This rank's order of one FFCV loader, wrapping FFCV's own TraversalOrder object.

    Installed as ``loader.traversal_order`` (ffcv 1.0.2's Loader rejects custom order classes passed as
    ``order``). ``set_epoch(epoch, start)`` selects FFCV's order for ``epoch`` and drops its first ``start``
    samples (a multiple of the batch: the batches a mid-epoch resume has already trained), so the remaining
    batches are exactly those an uninterrupted epoch would have produced next. Same interface as
    :class:`trainer.data.sampler.EpochSampler`.
    """

    def __init__(self, inner):
        self.inner, self.epoch, self.start = inner, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def indices(self) -> list[int]:
        """This rank's full sample order (FFCV indices) of the current epoch."""
        return [int(i) for i in self.inner.sample_order(self.epoch)]

    def sample_order(self, epoch: int):  # called by ffcv.Loader.__iter__
        return self.inner.sample_order(epoch)[self.start :]

    def __len__(self) -> int:
        return len(self.inner.sample_order(self.epoch)) - self.start


class FFCVLoader:
    """Iterable of batch dicts ``{"image": uint8 (B,3,S,S) on device, "label": int64 (B,), "bad": []}``.

    Each ``iter()`` runs the epoch selected by ``order.set_epoch`` (resolution and decoder seed follow it)
    and closes the previous epoch's FFCV iterator (its thread and buffers) if it was left unfinished.
    """

    def __init__(self, loader, order: FFCVOrder, decoder=None, size_for_epoch=None):
        self.loader, self.order, self.decoder, self.size_for_epoch = loader, order, decoder, size_for_epoch
        self._it = None

    def __iter__(self) -> Iterator[dict]:
        self.close()
        if self.decoder is not None:
            self.decoder.epoch = self.order.epoch
            s = self.size_for_epoch(self.order.epoch)
            self.decoder.output_size = (s, s)
        self.loader.next_epoch = self.order.epoch
        self._it = iter(self.loader)
        return self._batches(self._it)

    @staticmethod
    def _batches(it) -> Iterator[dict]:
        for image, label in it:
            # FFCV reuses its buffers a few batches later: the label is copied, the image is consumed (copied
            # to float by the task) before the next batch is requested.
            yield {"image": image, "label": label.reshape(-1).to(torch.int64, copy=True), "bad": []}

    def close(self) -> None:
        """Stop the running epoch's FFCV iterator thread, if any."""
        if self._it is not None:
            self._it.close()
            self._it = None


def build_loaders(cfg, info, train: BetonSplit, val: BetonSplit, micro: int, eval_bs: int):
    """FFCV train and val loaders for this rank: ``(FFCVLoader train, FFCVLoader val)``.

    ``micro``/``eval_bs``: per-rank batch sizes. Raises :class:`ConfigError` for ``ffcv_order=quasi_random``
    with more than one process (FFCV implements it for one process only).
    """
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.rgb_image import CenterCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import Squeeze, ToDevice, ToTensor, ToTorchImage

    from trainer.data.formats.ffcv_decoder import SeededRandomResizedCropDecoder

    if cfg.ffcv_order == "quasi_random" and info.world_size > 1:
        raise ConfigError(
            f"ffcv_order: got quasi_random with {info.world_size} processes; FFCV implements it "
            "for one process only: use ffcv_order=random"
        )
    dev, threads = info.device, max(cfg.num_workers, 1)

    def tail():
        return [ToTensor(), ToDevice(dev, non_blocking=True), ToTorchImage(channels_last=True)]

    def labels():
        return [IntDecoder(), ToTensor(), Squeeze(), ToDevice(dev, non_blocking=True)]

    size0 = train_size_for_epoch(cfg, 0)
    decoder = SeededRandomResizedCropDecoder(
        (size0, size0), scale=(cfg.crop_scale_min, 1.0), flip_prob=cfg.hflip_prob, seed=cfg.seed
    )
    order = OrderOption.QUASI_RANDOM if cfg.ffcv_order == "quasi_random" else OrderOption.RANDOM
    tl = Loader(
        str(train.path),
        batch_size=micro,
        num_workers=threads,
        os_cache=cfg.ffcv_os_cache,
        order=order,
        distributed=info.world_size > 1,
        seed=cfg.seed,
        drop_last=True,
        batches_ahead=cfg.prefetch_factor,
        recompile=True,
        pipelines={"image": [decoder, *tail()], "label": labels()},
    )
    tl.traversal_order = FFCVOrder(tl.traversal_order)
    val_idx = np.arange(info.rank, len(val), info.world_size)
    if len(val_idx) == 0:
        raise ConfigError(
            f"FFCV file {val.path}: {len(val)} samples for {info.world_size} processes; every "
            "process needs at least one"
        )
    vl = Loader(
        str(val.path),
        batch_size=eval_bs,
        num_workers=threads,
        os_cache=cfg.ffcv_os_cache,
        order=OrderOption.SEQUENTIAL,
        indices=val_idx,
        drop_last=False,
        batches_ahead=cfg.prefetch_factor,
        pipelines={
            "image": [CenterCropRGBImageDecoder((cfg.image_size,) * 2, ratio=cfg.val_resize_ratio), *tail()],
            "label": labels(),
        },
    )
    vl.traversal_order = FFCVOrder(vl.traversal_order)
    return (
        FFCVLoader(tl, tl.traversal_order, decoder, lambda e: train_size_for_epoch(cfg, e)),
        FFCVLoader(vl, vl.traversal_order),
    )
