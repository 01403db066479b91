"""``python -m trainer write-ffcv``: convert ImageFolder splits into FFCV ``.beton`` files.

The fields and options are those of FFCV's ImageNet example (ffcv-imagenet ``write_imagenet.py``):
``RGBImageField(write_mode, max_resolution, compress_probability, jpeg_quality)`` for the image, ``IntField``
for the label, ``DatasetWriter(path, fields, num_workers).from_indexed_dataset(ds, chunksize)``. Its
defaults are ffcv-imagenet's published ResNet-50 files (``train_500_0.50_90.ffcv``): max side 500 px,
``proportion`` mode with half the images JPEG-compressed at quality 90, the rest stored raw.

Files are read in :func:`trainer.data.imagefolder.scan_split` order (so FFCV index i is ImageFolder index i)
and decoded by :func:`trainer.data.imagefolder.decode_file` (the ImageFolder path's decoder: GIF, PNG named
.jpg, CMYK JPEG...). A file that cannot be decoded fails the conversion, naming it, and no ``.ffcv`` is left
behind. Next to each ``<split>.ffcv`` a ``<split>.json`` records the class names, the sample count and the
options, so the trainer can check that train and val agree on the classes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from trainer.data.imagefolder import DataError, SplitScan, decode_file, scan_split

WRITE_MODES = ("proportion", "smart", "jpg", "raw")


@dataclass
class FFCVWriteOptions:
    """Options of one conversion (ffcv-imagenet ``write_imagenet.py``'s, same names and defaults)."""

    data_dir: str
    ffcv_dir: str
    splits: list[str] = field(default_factory=lambda: ["train", "val"])
    write_mode: str = "proportion"
    max_resolution: int = 500
    compress_probability: float = 0.5
    jpeg_quality: int = 90
    num_workers: int = 16
    chunk_size: int = 100

    def validate(self) -> "FFCVWriteOptions":
        """Raise :class:`DataError` naming the first invalid option."""
        if self.write_mode not in WRITE_MODES:
            raise DataError(f"write_mode: got {self.write_mode!r}; allowed: {', '.join(WRITE_MODES)}")
        if self.max_resolution < 16:
            raise DataError(f"max_resolution: got {self.max_resolution}; must be >= 16 (pixels, longest side)")
        if not 0.0 <= self.compress_probability <= 1.0:
            raise DataError(f"compress_probability: got {self.compress_probability}; must be in [0, 1]")
        if not 1 <= self.jpeg_quality <= 100:
            raise DataError(f"jpeg_quality: got {self.jpeg_quality}; must be in [1, 100]")
        if self.num_workers < 1 or self.chunk_size < 1:
            raise DataError(f"num_workers/chunk_size: got {self.num_workers}/{self.chunk_size}; must be >= 1")
        return self


class _DecodedSplit:
    """Indexable ``i -> (uint8 (H, W, 3) numpy image, int label)`` for FFCV's writer processes.

    FFCV's writer waits forever for a worker that raised, so a file that cannot be decoded is written as a
    1x1 black placeholder and its path appended to ``bad_log`` (one line per file, O_APPEND); the caller
    then fails the conversion naming those files.
    """

    def __init__(self, scan: SplitScan, bad_log: str):
        self.samples, self.bad_log = scan.samples, bad_log

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        try:
            img = decode_file(path).permute(1, 2, 0).contiguous().numpy()
        except Exception as e:  # noqa: BLE001 - any decoder error: record and fail after the write
            with open(self.bad_log, "a") as f:
                f.write(f"{path}\t{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}\n")
            img = np.zeros((1, 1, 3), dtype=np.uint8)
        return img, label


def write_split(opts: FFCVWriteOptions, split: str) -> dict:
    """Convert ``<data_dir>/<split>`` into ``<ffcv_dir>/<split>.ffcv`` (+ ``<split>.json``).

    Returns the summary: ``samples``, ``classes``, ``bytes`` (of the .ffcv), ``source_bytes`` (the image
    files), ``jpg``/``raw`` sample counts, ``seconds``. Raises :class:`DataError` for a missing/empty split or
    undecodable files (the partial output is removed). Needs the ffcv extra (``make ffcv``).
    """
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    scan = scan_split(opts.data_dir, split)
    out_dir = Path(opts.ffcv_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out, meta = out_dir / f"{split}.ffcv", out_dir / f"{split}.json"
    tmp = out_dir / f".{split}.ffcv.partial"
    fd, bad_log = tempfile.mkstemp(prefix=f".{split}-bad-", dir=out_dir)
    os.close(fd)
    t0 = time.perf_counter()
    try:
        writer = DatasetWriter(str(tmp), {
            "image": RGBImageField(write_mode=opts.write_mode, max_resolution=opts.max_resolution,
                                   compress_probability=opts.compress_probability, jpeg_quality=opts.jpeg_quality),
            "label": IntField(),
        }, num_workers=min(opts.num_workers, len(scan.samples)))
        print(f"write-ffcv: {scan.root} ({scan.census()}) -> {out}", flush=True)
        writer.from_indexed_dataset(_DecodedSplit(scan, bad_log), chunksize=opts.chunk_size)  # tqdm bar
        bad = Path(bad_log).read_text().splitlines()
        if bad:
            raise DataError(f"write-ffcv {split}: {len(bad)} file(s) cannot be decoded; remove or fix them and "
                            "run again: " + "; ".join(b.replace("\t", " (", 1) + ")" for b in bad[:5]))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        Path(bad_log).unlink(missing_ok=True)
    summary = _summarise(out, scan, time.perf_counter() - t0)
    meta.write_text(json.dumps({"split": split, "source": str(scan.root), "classes": scan.classes,
                                "samples": len(scan.samples), "options": asdict(opts), "summary": summary},
                               indent=1))
    return summary


def _summarise(path: Path, scan: SplitScan, seconds: float) -> dict:
    from ffcv.reader import Reader

    image = Reader(str(path)).metadata["f0"]
    return {"samples": len(scan.samples), "classes": len(scan.classes), "bytes": path.stat().st_size,
            "source_bytes": sum(os.path.getsize(p) for p, _ in scan.samples),
            "jpg": int((image["mode"] == 0).sum()), "raw": int((image["mode"] == 1).sum()),
            "max_side": int(max(image["width"].max(), image["height"].max())), "seconds": round(seconds, 2)}


def format_summary(split: str, s: dict) -> str:
    """One line: ``train: 245 samples, 2 classes, 23.1 MB (source 46.2 MB, 0.50x), 123 jpg + 122 raw, ...``."""
    return (f"{split}: {s['samples']} samples, {s['classes']} classes, {s['bytes'] / 1e6:.1f} MB "
            f"(source {s['source_bytes'] / 1e6:.1f} MB, {s['bytes'] / max(s['source_bytes'], 1):.2f}x), "
            f"{s['jpg']} jpg + {s['raw']} raw, longest side {s['max_side']} px, {s['seconds']:.1f} s")


def add_write_ffcv_command(sub) -> None:
    """Register the ``write-ffcv`` sub-command on ``sub`` (an argparse sub-parsers object)."""
    p = sub.add_parser("write-ffcv", help="convert ImageFolder splits into FFCV .ffcv files (needs the ffcv extra)",
                       description=__doc__.split("\n\n")[0])
    d = FFCVWriteOptions("", "")
    p.add_argument("--data-dir", required=True, help="ImageFolder root (<data-dir>/<split>/<class>/<image>)")
    p.add_argument("--ffcv-dir", required=True, help="output folder: <ffcv-dir>/<split>.ffcv and <split>.json")
    p.add_argument("--splits", nargs="+", default=d.splits, help="splits to convert (default: train val)")
    p.add_argument("--write-mode", choices=WRITE_MODES, default=d.write_mode,
                   help="raw pixels, JPEG, 'smart' (JPEG when raw is much larger) or 'proportion' (JPEG a "
                        "random compress_probability share)")
    p.add_argument("--max-resolution", type=int, default=d.max_resolution,
                   help="longest side in pixels; larger images are downscaled (INTER_AREA)")
    p.add_argument("--compress-probability", type=float, default=d.compress_probability,
                   help="share of images JPEG-compressed in 'proportion' mode")
    p.add_argument("--jpeg-quality", type=int, default=d.jpeg_quality, help="JPEG quality (1-100)")
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="writer processes")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="samples per work item")


def run_write_ffcv(args: argparse.Namespace) -> int:
    """Run ``write-ffcv``; returns 0, or 2 (message on stderr) for a missing extra, bad option or bad data."""
    from trainer.data.ffcv import require_ffcv

    try:
        require_ffcv()
        opts = FFCVWriteOptions(**{k: getattr(args, k) for k in FFCVWriteOptions.__dataclass_fields__}).validate()
        summaries = {s: write_split(opts, s) for s in opts.splits}
    except DataError as e:
        print(f"error: DataError: {e}", file=sys.stderr, flush=True)
        return 2
    for split, s in summaries.items():
        print("write-ffcv: " + format_summary(split, s), flush=True)
    return 0
