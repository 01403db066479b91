"""JPEG decode on the training device (``decode_device: cuda``, classification ImageFolder only).

Workers read a JPEG's bytes and header but decode nothing (:func:`read_jpeg_for_device`, an :class:`EncodedJpeg`
carrying the crop drawn from the sample's seeded stream); files the device decoder does not take (non-JPEG,
CMYK, truncated, unreadable) are decoded in the worker as with ``decode_device: cpu``.
:func:`collate_encoded` batches both kinds (the encoded bytes concatenated into one tensor) and
:func:`decode_on_device` decodes the batch there (batched nvJPEG on CUDA, on a stream of its own:
:func:`_decode_jpegs`), then crops and flips it, or applies the evaluation transform.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from trainer.data.formats.image_decode import open_header, to_uint8
from trainer.data.samples import BadSample, describe_error
from trainer.data.transforms import CropParams, apply_train_crop
from trainer.errors import DataError

#: PIL modes of the JPEGs left to the device decoder (decoded with ``ImageReadMode.RGB``, grey replicated to
#: three channels); CMYK/YCCK (``CMYK``) and anything else are decoded in the worker.
DEVICE_JPEG_MODES = ("RGB", "L")


@dataclass(frozen=True)
class EncodedJpeg:
    """A JPEG read but not decoded (``decode_device="cuda"``): ``data`` uint8 (n_bytes,) the file's bytes,
    ``height``/``width`` from its header (pixels), ``crop`` the training crop drawn in the worker
    (:data:`~trainer.data.transforms.CropParams`; None in evaluation: the device applies the eval transform)."""

    path: str
    data: torch.Tensor
    height: int
    width: int
    crop: Optional[CropParams] = None


def _ends_with_eoi(data: torch.Tensor) -> bool:
    """Whether the JPEG bytes end with the end-of-image marker ``FF D9`` (trailing NUL/whitespace padding
    allowed): a truncated file does not, and goes to the worker decode, which reports it as today."""
    tail = bytes(data[-64:].numpy()).rstrip(b"\x00\r\n ")
    return tail.endswith(b"\xff\xd9")


def read_jpeg_for_device(path: str) -> Optional[EncodedJpeg]:
    """The bytes and header size of ``path`` when the device decoder is to take it, else None.

    None (the worker decodes the file with :func:`~trainer.data.formats.image_decode.decode_file`, today's path,
    which also names why a bad file is bad) for: an empty file, content that does not start with the JPEG SOI
    marker ``FF D8 FF`` (PNG, GIF, ... whatever the extension), a header PIL cannot read or that claims more than
    :data:`~trainer.data.formats.image_decode.MAX_IMAGE_PIXELS`, a PIL mode outside :data:`DEVICE_JPEG_MODES`
    (CMYK), bytes without the end-of-image marker (truncated).
    Cost: one file read and a PIL header parse (no pixel decoded).

    Raises:
        OSError: the file cannot be read (the caller treats it as a file for the worker decode).
    """
    from torchvision.io import read_file

    if os.path.getsize(path) == 0:
        return None
    data = read_file(path)
    if data.numel() < 4 or bytes(data[:3].numpy()) != b"\xff\xd8\xff" or not _ends_with_eoi(data):
        return None
    try:
        with open_header(io.BytesIO(data.numpy())) as im:
            if im.format != "JPEG" or im.mode not in DEVICE_JPEG_MODES:
                return None
            width, height = im.size
    except Exception:  # noqa: BLE001 - unreadable or too large: decode_file decides and names why
        return None
    return EncodedJpeg(path, data, height, width)


def collate_encoded(items: list) -> dict:
    """Batch the samples of a ``decode_device="cuda"``
    :class:`~trainer.data.formats.imagefolder.ImageFolderDataset` (encoded JPEGs and worker-decoded fallbacks in
    one batch), for :func:`decode_on_device`.

    Returns, for B good samples of which k are encoded JPEGs and m = B - k were decoded in the worker::

        {"label": int64 (B,), "bad": [BadSample, ...]  (as collate_skip_bad),
         "jpeg": uint8 (sum of n_bytes_i,)  the k files' bytes, concatenated,
         "jpeg_offsets": int64 (k + 1,)     file i is jpeg[offsets[i]:offsets[i + 1]] (jpeg_list() splits),
         "jpeg_pos": int64 (k,)             their positions in the batch,
         "jpeg_hw": int64 (k, 2)            header height, width,
         "jpeg_path": [str] * k,
         "crop": int64 (k, 7) or None       CropParams rows (None: evaluation, no random step),
         "decoded": uint8 (m, 3, h, w)      fallbacks (non-JPEG, CMYK, truncated), already transformed,
         "decoded_pos": int64 (m,)}

    The variable-length files travel as one concatenated tensor, not a list of k tensors: a DataLoader worker
    hands each tensor's storage to the main process as its own shared-memory file descriptor, and a list of 64
    encoded files per batch exhausted that (``OSError: [Errno 9] Bad file descriptor`` in the worker's queue
    feeder, then a hung loader, with one worker on imagenette); one tensor is one descriptor per batch.

    Raises:
        ValueError: some encoded samples carry a crop and others do not (two datasets mixed).
    """
    good = [it for it in items if not isinstance(it, BadSample)]
    bad = [it for it in items if isinstance(it, BadSample)] + [b for g in good for b in g[2]]
    enc = [(i, g[0]) for i, g in enumerate(good) if isinstance(g[0], EncodedJpeg)]
    dec = [(i, g[0]) for i, g in enumerate(good) if not isinstance(g[0], EncodedJpeg)]
    crops = [e.crop for _, e in enc]
    if any(c is None for c in crops) and any(c is not None for c in crops):
        raise ValueError("collate_encoded: a batch mixes samples with and without a training crop")
    return {
        "label": torch.tensor([g[1] for g in good], dtype=torch.int64),
        "bad": bad,
        "jpeg": torch.cat([e.data for _, e in enc]) if enc else torch.empty((0,), dtype=torch.uint8),
        "jpeg_offsets": torch.tensor([0] + [e.data.numel() for _, e in enc], dtype=torch.int64).cumsum(0),
        "jpeg_pos": torch.tensor([i for i, _ in enc], dtype=torch.int64),
        "jpeg_hw": torch.tensor([[e.height, e.width] for _, e in enc], dtype=torch.int64).view(-1, 2),
        "jpeg_path": [e.path for _, e in enc],
        "crop": torch.tensor(crops, dtype=torch.int64).view(-1, 7) if enc and crops[0] is not None else None,
        "decoded": torch.stack([d for _, d in dec]) if dec else torch.empty((0, 3, 1, 1), dtype=torch.uint8),
        "decoded_pos": torch.tensor([i for i, _ in dec], dtype=torch.int64),
    }


def jpeg_list(batch: dict) -> list[torch.Tensor]:
    """The encoded files of a :func:`collate_encoded` batch as a list of k uint8 (n_bytes_i,) views (no copy)."""
    sizes = batch["jpeg_offsets"].diff().tolist()
    return list(torch.split(batch["jpeg"], sizes)) if sizes else []


_DECODE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _decode_jpegs(data: list, paths: list, device: torch.device) -> tuple[list, list]:
    """``(images, failed)``: uint8 (3, H, W) on ``device`` per input (None where it failed) and the
    :class:`BadSample` of each failure (see :func:`_decode_jpegs_here`).

    On CUDA the decode runs with a stream of its own current (one per device), and the caller's stream then
    waits for it, so the training stream is never synchronised with the host. torchvision's nvJPEG decoder
    allocates its outputs on the *current* stream but writes them from a private stream that does not wait
    for it; with the training stream current, the caching allocator hands it blocks that queued training
    kernels have yet to read, and the decode overwrites them (pytorch/vision PR 9606). On the side stream the
    outputs come from that stream's own blocks, each marked as used by the caller's stream
    (``record_stream``), so none is handed out again before the training kernels that read it have run.
    """
    if not data or device.type != "cuda":
        return _decode_jpegs_here(data, paths, device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    main = torch.cuda.current_stream(index)
    side = _DECODE_STREAMS.get(index)
    if side is None:
        side = _DECODE_STREAMS[index] = torch.cuda.Stream(index)
    with torch.cuda.stream(side):
        images, failed = _decode_jpegs_here(data, paths, device)
    main.wait_stream(side)
    for img in images:
        if img is not None:
            img.record_stream(main)
    return images, failed


def _decode_jpegs_here(data: list, paths: list, device: torch.device) -> tuple[list, list]:
    """:func:`_decode_jpegs` on the current stream.

    One batched ``torchvision.io.decode_jpeg(list, mode=RGB, device=device)`` call (on CUDA torchvision decodes
    the list as one nvJPEG batch); if it raises, each file again alone, then on the CPU
    (``torchvision.io.decode_image``, the worker path's decoder) and copied to ``device``.
    """
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    if not data:
        return [], []
    try:
        return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device)), []
    except RuntimeError:
        pass
    images, failed = [], []
    for d, path in zip(data, paths):
        try:
            images.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=device))
            continue
        except RuntimeError:
            pass
        try:
            images.append(to_uint8(decode_image(d, mode=ImageReadMode.RGB)).to(device))
        except Exception as e:  # noqa: BLE001 - corrupt body: a bad file (see decode_on_device)
            images.append(None)
            failed.append(BadSample(path, describe_error(e)))
    return images, failed


def decode_on_device(
    batch: dict, device: torch.device, eval_transform: Optional[Callable] = None, replace_bad: bool = True
) -> tuple[torch.Tensor, torch.Tensor, list[BadSample]]:
    """Decode and crop a :func:`collate_encoded` batch on ``device``: ``(images, labels, failed)``.

    ``images`` uint8 (B', 3, h, w) on ``device``, in batch order: each JPEG decoded
    (``torchvision.io.decode_jpeg`` with ``ImageReadMode.RGB``: batched nvJPEG on CUDA, libjpeg-turbo on CPU),
    then its training crop (:func:`~trainer.data.transforms.apply_train_crop`) or, without crops,
    ``eval_transform`` (e.g. :func:`~trainer.data.transforms.val_transform`, applied on ``device``); the
    worker-decoded fallbacks copied in. ``labels`` int64 (B',) on the host. On the CPU device the images are
    identical (torch.equal) to the ``decode_device="cpu"`` path for the same (seed, epoch, indices).

    A JPEG that passed the worker's header checks but that no decoder reads (a corrupt body) is a bad file
    found too late to count in the loop's ``max_bad_fraction`` (the engine has read ``batch["bad"]``): it is
    returned in ``failed`` and, when ``replace_bad`` (training), replaced by the batch's first good image so
    the shape stays; otherwise (evaluation) dropped with its label.

    Raises:
        DataError: every image of a training batch failed to decode.
        ValueError: a batch without crops and no ``eval_transform``; a decoded size differs from the header's.
    """
    labels = batch["label"]
    out: list = [None] * len(labels)
    images, failed = _decode_jpegs(jpeg_list(batch), batch["jpeg_path"], device)
    crops = batch["crop"]
    if images and crops is None and eval_transform is None:
        raise ValueError("decode_on_device: the batch has no crops; pass eval_transform")
    for k, (pos, img) in enumerate(zip(batch["jpeg_pos"].tolist(), images)):
        if img is None:
            continue
        h, w = batch["jpeg_hw"][k].tolist()
        if tuple(img.shape[-2:]) != (h, w):
            raise ValueError(
                f"decode_on_device: {batch['jpeg_path'][k]} decoded to {tuple(img.shape[-2:])}, header said {(h, w)}"
            )
        out[pos] = apply_train_crop(img, crops[k].tolist()) if crops is not None else eval_transform(img)
    for pos, img in zip(batch["decoded_pos"].tolist(), batch["decoded"]):
        out[pos] = img.to(device, non_blocking=True)
    keep = [i for i, x in enumerate(out) if x is not None]
    if failed:
        warnings.warn(
            f"data: {len(failed)} JPEG(s) could not be decoded on {device} (not counted in max_bad_fraction): "
            + "; ".join(f"{b.path} ({b.error})" for b in failed[:3]),
            stacklevel=2,
        )
        if replace_bad:
            if not keep:
                raise DataError(f"no image of the batch could be decoded, e.g. {failed[0].path} ({failed[0].error})")
            out = [x if x is not None else out[keep[0]] for x in out]
        else:
            out, labels = [out[i] for i in keep], labels[keep]
    if not out:
        return torch.empty((0, 3, 1, 1), dtype=torch.uint8, device=device), labels, failed
    return torch.stack(out), labels, failed
