"""One image file to a uint8 RGB tensor on the CPU: the decoder every image format here shares.

* the header is read first (PIL: nothing decoded, :func:`open_header`) and a file whose header claims more than
  :data:`MAX_IMAGE_PIXELS` pixels is refused (:class:`ImageTooLargeError`) before any pixel is decoded;
  :func:`check_header` is that check alone;
* :func:`decode_file` then decodes with ``torchvision.io.decode_image`` (content-sniffed: JPEG, PNG, GIF, WEBP)
  and falls back to PIL for BMP/TIFF/PPM;
* any dtype a decoder returns (16-bit PNG, PIL's ``I;16``/``I``/``F`` modes) is scaled to 8 bits
  (:func:`to_uint8`), so every file gives the same dtype and range whatever its bit depth.

Used by the ImageFolder dataset and its file checks (:mod:`trainer.data.formats.imagefolder`), the device JPEG
path's header check and CPU fallback (:mod:`trainer.data.formats.device_jpeg`), COCO, segmentation, the FFCV
writer and prediction.
"""

from __future__ import annotations

import io
import os
import re
import warnings

import torch

#: Largest image accepted, in pixels (width x height as the file header states it), checked before decoding:
#: a few-KB PNG or JPEG can claim 65,000 x 65,000 pixels and decode to 12.7 GB. The value is PIL's default
#: ``PIL.Image.MAX_IMAGE_PIXELS`` (its decompression-bomb warning threshold, 89,478,485 pixels, e.g.
#: 9,459 x 9,459): far above any training photo (ImageNet's largest is ~ 7,000 x 5,000). A larger file is a
#: bad file (skipped and counted under ``max_bad_fraction``, named in the log).
MAX_IMAGE_PIXELS = 89_478_485


class ImageTooLargeError(ValueError):
    """The file header claims more than :data:`MAX_IMAGE_PIXELS` pixels."""


def open_header(fp):
    """``PIL.Image.open`` (reads the header only; nothing is decoded) with the :data:`MAX_IMAGE_PIXELS` check.

    Raises:
        ImageTooLargeError: the header claims more than :data:`MAX_IMAGE_PIXELS` pixels.
        PIL.UnidentifiedImageError / OSError / SyntaxError: PIL cannot read the header.
    """
    from PIL import Image

    with warnings.catch_warnings():  # PIL warns above its own limit (ours), and refuses above twice that
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(fp)
        except Image.DecompressionBombError as e:  # PIL's own refusal, above twice its limit
            n = re.search(r"\((\d+) pixels\)", str(e))
            claims = f"{int(n.group(1)):,}" if n else "too many"
            raise ImageTooLargeError(
                f"header says {claims} pixels, more than MAX_IMAGE_PIXELS={MAX_IMAGE_PIXELS:,}; not decoded"
            ) from None
    w, h = im.size
    if w * h > MAX_IMAGE_PIXELS:
        im.close()
        raise ImageTooLargeError(
            f"header says {w}x{h} = {w * h:,} pixels, more than MAX_IMAGE_PIXELS={MAX_IMAGE_PIXELS:,}; not decoded"
        )
    return im


def check_header(path: str) -> tuple[int, int]:
    """``(width, height)`` of an image file from its header (PIL; cheap: no pixel is decoded).

    Raises:
        ImageTooLargeError: more than :data:`MAX_IMAGE_PIXELS` pixels.
        OSError / SyntaxError / ValueError: PIL cannot read the header (not an image, empty, corrupt header).
    """
    if os.path.getsize(path) == 0:
        raise OSError("empty file (0 bytes)")
    with open_header(path) as im:
        return im.size


def to_uint8(img: torch.Tensor) -> torch.Tensor:
    """Scale an image tensor of any dtype to uint8 on the full range (never by truncation).

    uint16 (16-bit PNG): ``x >> 8``; other integers: ``x >> (bits - 8)`` of their non-negative range
    (negatives clipped to 0); floats are taken as [0, 1] (clipped) and scaled by 255
    (``torchvision.transforms.v2.functional.to_dtype(..., scale=True)``). uint8 is returned as is.
    """
    if img.dtype == torch.uint8:
        return img
    from torchvision.transforms.v2.functional import to_dtype

    if img.is_floating_point():
        img = img.clamp(0.0, 1.0)
    elif img.dtype != torch.uint16 and img.dtype.is_signed:
        img = img.clamp(min=0)
    return to_dtype(img, torch.uint8, scale=True)


def _decode_pil(path: str) -> torch.Tensor:
    """PIL decode (BMP, TIFF, PPM/PGM, ...) to a tensor (3, H, W); high-bit-depth modes keep their depth
    (``I;16*`` -> uint16, ``I`` -> uint16 when its values fit, else int32; ``F`` -> float32) so that
    :func:`to_uint8` scales them (``Image.convert("RGB")`` would clip them at 255)."""
    import numpy as np

    with open_header(path) as im:
        if im.mode.startswith("I;16"):
            arr = np.array(im).astype(np.uint16)
        elif im.mode == "I":
            arr = np.array(im)
            if arr.size and arr.min() >= 0 and arr.max() <= 65535:  # 16-bit content (PNG/TIFF/PGM read as I)
                arr = arr.astype(np.uint16)
        elif im.mode == "F":
            arr = np.array(im, dtype=np.float32)
        else:
            return torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)
    return torch.from_numpy(arr).unsqueeze(0).expand(3, -1, -1).contiguous()


def decode_file(path: str) -> torch.Tensor:
    """Decode an image file to a uint8 RGB tensor of shape (3, H, W).

    The header is read first (PIL, no decoding) and a file whose header claims more than
    :data:`MAX_IMAGE_PIXELS` pixels is refused. Then torchvision.io (JPEG, PNG, GIF, WEBP; first frame of an
    animated GIF), PIL for other formats. 16-bit PNGs (torchvision returns uint16), PIL's ``I;16``/``I``/``F``
    modes and any other non-uint8 output are scaled to 8 bits by :func:`to_uint8`, so every file of a folder
    gives the same dtype and range whatever its bit depth.

    Raises:
        ImageTooLargeError: the header claims more than :data:`MAX_IMAGE_PIXELS` pixels.
        RuntimeError / OSError: neither decoder can read the file.
    """
    from torchvision.io import ImageReadMode, decode_image, read_file

    if os.path.getsize(path) == 0:
        raise OSError("empty file (0 bytes)")
    data = read_file(path)
    try:
        open_header(io.BytesIO(data.numpy())).close()
    except ImageTooLargeError:
        raise
    except Exception:  # noqa: BLE001 - PIL cannot read the header: the decoders below decide (and name why)
        pass
    try:
        img = decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError as tv_error:
        try:
            img = _decode_pil(path)
        except ImageTooLargeError:
            raise
        except Exception:
            raise tv_error from None
    if img.ndim == 4:  # animated GIF: (T, C, H, W)
        img = img[0]
    return to_uint8(img)
