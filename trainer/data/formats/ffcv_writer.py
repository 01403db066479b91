"""``python -m trainer write-ffcv``: convert ImageFolder splits into FFCV ``.beton`` files.

The fields and options are those of FFCV's ImageNet example (ffcv-imagenet ``write_imagenet.py``):
``RGBImageField(write_mode, max_resolution, compress_probability, jpeg_quality)`` for the image, ``IntField``
for the label, ``DatasetWriter(path, fields, num_workers).from_indexed_dataset(ds, chunksize)``. Its
defaults are ffcv-imagenet's published ResNet-50 files (``train_500_0.50_90.ffcv``): max side 500 px,
``proportion`` mode with half the images JPEG-compressed at quality 90, the rest stored raw.

Files are read in :func:`trainer.data.formats.imagefolder.scan_split` order (so FFCV index i is ImageFolder index i)
and decoded by :func:`trainer.data.formats.image_decode.decode_file` (the ImageFolder path's decoder: GIF, PNG named
.jpg, CMYK JPEG, 16-bit PNG scaled to 8 bits, the pixel limit...). A file that cannot be decoded fails the
conversion, naming it, and no ``.ffcv`` is left behind. Next to each ``<split>.ffcv`` a ``<split>.json``
records the class names, the sample count and the options, so the trainer can check that train and val agree
on the classes.

FFCV 1.0.2's writer waits forever when one of its worker processes dies (its progress loop polls a counter
that stops growing; the other workers spin waiting for the dead one's page). So nothing our data can do
raises there: the dataset handed to it decodes, checks and resizes each image itself (a bad file becomes a
1x1 placeholder, recorded, and fails the conversion afterwards), the page size fits the largest sample, and
:class:`_WatchedWriter` also watches the workers' exit statuses: any worker failure (an encoder error, the
OOM killer) stops the others and ends the conversion with a :class:`DataError` instead of a hang.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainer.errors import DataError, error_detail

if TYPE_CHECKING:
    from trainer.data.formats.imagefolder import SplitScan

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

    def validate(self) -> FFCVWriteOptions:
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


_CURRENT_PATH: list[str] = []  #: the file being converted in this writer process (named if its encoding fails)


class _DecodedSplit:
    """Indexable ``i -> (uint8 (H, W, 3) numpy image, int label)`` for FFCV's writer processes; never raises.

    Each image is decoded (:func:`decode_file`: uint8 whatever the bit depth, pixel limit checked) and
    resized to ``max_resolution`` with FFCV's own ``resizer`` (the field's resize then does nothing, so the
    output is the same). A file that fails any of this is written as a 1x1 black placeholder and its path
    appended to ``bad_log`` (one line per file, O_APPEND); the caller then fails the conversion naming those
    files.
    """

    def __init__(self, scan: SplitScan, bad_log: str, max_resolution: int):
        self.samples, self.bad_log, self.max_resolution = scan.samples, bad_log, max_resolution

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from ffcv.fields.rgb_image import resizer

        from trainer.data.formats.image_decode import decode_file  # torch: not imported to parse the command line

        path, label = self.samples[i]
        _CURRENT_PATH[:] = [path]
        try:
            img = np.ascontiguousarray(decode_file(path).permute(1, 2, 0).numpy())
            img = np.ascontiguousarray(resizer(img, self.max_resolution))
            if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3 or min(img.shape[:2]) < 1:
                raise ValueError(f"decoded to {img.dtype} {img.shape}; expected uint8 (H, W, 3)")
        except Exception as e:  # noqa: BLE001 - any decoder error: record and fail after the write
            with open(self.bad_log, "a") as f:
                f.write(f"{path}\t{error_detail(e)}\n")
            img = np.zeros((1, 1, 3), dtype=np.uint8)
        return img, int(label)


def _page_size(max_resolution: int) -> int:
    """FFCV page size (bytes, power of two) that holds the largest sample: a raw max_resolution^2 RGB image,
    or a JPEG of it (at most about twice that), plus headers. FFCV's worker fails on a larger sample. Between
    FFCV's default (8 MiB) and its largest (2 GiB)."""
    from ffcv.writer import MAX_PAGE_SIZE, MIN_PAGE_SIZE

    need = 2 * 3 * max_resolution * max_resolution + (1 << 16)
    return min(max(4 * MIN_PAGE_SIZE, 1 << (need - 1).bit_length()), MAX_PAGE_SIZE // 2)


class WriterFailed(DataError):
    """A writer process of FFCV's DatasetWriter ended with an error; the others were stopped."""


def _guarded_worker(work_fn, errors, *args) -> None:
    """Run FFCV's worker function; on any error, send one line to ``errors`` and exit with status 1 (no
    traceback on the terminal: the parent reports it)."""
    try:
        work_fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        where = f" (while converting {_CURRENT_PATH[0]})" if _CURRENT_PATH else ""
        errors.put(f"{error_detail(e, 300)}{where}")
        errors.close()
        errors.join_thread()
        raise SystemExit(1) from None


_WRITER_CLS = None


def _watched_writer():
    """:class:`_WatchedWriter`: ``ffcv.writer.DatasetWriter`` whose wait loop also watches its workers."""
    global _WRITER_CLS
    if _WRITER_CLS is not None:
        return _WRITER_CLS
    from multiprocessing import Process, Queue, Value

    from ffcv.memory_allocator import MemoryAllocator
    from ffcv.writer import DatasetWriter
    from tqdm import tqdm

    class _WatchedWriter(DatasetWriter):
        """FFCV 1.0.2's ``DatasetWriter`` with ``_write_common`` (its process orchestration) rewritten to
        watch the workers: same queues, allocator, progress bar and ``finalize``; in addition, when a worker
        ends with a non-zero status (its error arrives on a queue), the others are terminated, the shared
        metadata memory is released and :class:`WriterFailed` is raised. Ctrl-C cleans up the same way."""

        def _write_common(self, num_samples, queue_content, work_fn, extra_worker_args):
            self.num_samples = num_samples
            self.prepare()
            workqueue, allocations_queue, errors = Queue(), Queue(), Queue()
            for todo in queue_content:
                workqueue.put(todo)
            for _ in range(self.num_workers):
                workqueue.put(None)
            done_number = Value(ctypes.c_uint64, 0)
            allocator = MemoryAllocator(self.fname, self.data_region_start, self.page_size)
            worker_args = (
                workqueue,
                self.metadata_sm,
                self.metadata_type,
                self.fields,
                allocator,
                done_number,
                allocations_queue,
                *extra_worker_args,
            )
            processes = [
                Process(target=_guarded_worker, args=(work_fn, errors, *worker_args)) for _ in range(self.num_workers)
            ]
            ok = False

            def check() -> int:  # samples done; raises WriterFailed when a worker ended badly
                codes = [p.exitcode for p in processes]  # before the count: if all ended, the count is final
                value = done_number.value
                failed = [c for c in codes if c not in (None, 0)]
                if failed or (None not in codes and value != num_samples):
                    try:
                        why = errors.get(timeout=2)
                    except Exception:  # noqa: BLE001 - killed before it could say why
                        why = (
                            f"exit status {failed[0]}"
                            + (" (killed by a signal: out of memory?)" if failed[0] < 0 else "")
                            if failed
                            else "workers ended early"
                        )
                    raise WriterFailed(f"a writer process failed after {value} of {num_samples} samples: {why}")
                return value

            try:
                for p in processes:
                    p.start()
                with tqdm(total=num_samples) as progress:
                    previous = 0
                    while previous != num_samples:
                        value = check()
                        if value > previous:
                            progress.update(value - previous)
                        previous = value
                        if previous != num_samples:
                            time.sleep(0.1)
                allocation_list = []
                while len(allocation_list) < len(processes):  # a worker can still fail writing its last page
                    try:
                        allocation_list.append(allocations_queue.get(timeout=0.5))
                    except queue.Empty:
                        check()
                self.finalize([a for part in allocation_list for a in part])
                ok = True
            finally:
                for p in processes:
                    if not ok and p.is_alive():
                        p.terminate()
                    p.join(timeout=None if ok else 10)
                self.metadata_sm.close()
                self.metadata_sm.unlink()

    _WRITER_CLS = _WatchedWriter
    return _WRITER_CLS


def write_split(opts: FFCVWriteOptions, split: str) -> dict:
    """Convert ``<data_dir>/<split>`` into ``<ffcv_dir>/<split>.ffcv`` (+ ``<split>.json``).

    Returns the summary: ``samples``, ``classes``, ``bytes`` (of the .ffcv), ``source_bytes`` (the image
    files), ``jpg``/``raw`` sample counts, ``seconds``. Raises :class:`DataError` for a missing/empty split,
    undecodable files (named) or a failed writer process; nothing is left behind then (no partial file, no
    bad-file log, and ``ffcv_dir`` itself when this call created it). Needs the ffcv extra (``make ffcv``).
    """
    from ffcv.fields import IntField, RGBImageField

    from trainer.data.formats.imagefolder import scan_split

    scan = scan_split(opts.data_dir, split)
    out_dir = Path(opts.ffcv_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    out, meta = out_dir / f"{split}.ffcv", out_dir / f"{split}.json"
    tmp = out_dir / f".{split}.ffcv.partial"
    fd, bad_log = tempfile.mkstemp(prefix=f".{split}-bad-", dir=out_dir)
    os.close(fd)
    t0 = time.perf_counter()
    try:
        writer = _watched_writer()(
            str(tmp),
            {
                "image": RGBImageField(
                    write_mode=opts.write_mode,
                    max_resolution=opts.max_resolution,
                    compress_probability=opts.compress_probability,
                    jpeg_quality=opts.jpeg_quality,
                ),
                "label": IntField(),
            },
            num_workers=min(opts.num_workers, len(scan.samples)),
            page_size=_page_size(opts.max_resolution),
        )
        print(f"write-ffcv: {scan.root} ({scan.census()}) -> {out}", flush=True)
        try:  # tqdm bar
            writer.from_indexed_dataset(_DecodedSplit(scan, bad_log, opts.max_resolution), chunksize=opts.chunk_size)
        except WriterFailed as e:
            raise WriterFailed(f"write-ffcv {split}: {e}; nothing written") from None
        except OSError as e:  # full disk, read-only folder...
            raise DataError(f"write-ffcv {split}: cannot write {tmp} ({e}); nothing written") from None
        bad = Path(bad_log).read_text().splitlines()
        if bad:
            raise DataError(
                f"write-ffcv {split}: {len(bad)} file(s) cannot be decoded; remove or fix them and "
                "run again: " + "; ".join(b.replace("\t", " (", 1) + ")" for b in bad[:5])
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        Path(bad_log).unlink(missing_ok=True)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
    summary = _summarise(out, scan, time.perf_counter() - t0)
    meta.write_text(
        json.dumps(
            {
                "split": split,
                "source": str(scan.root),
                "classes": scan.classes,
                "samples": len(scan.samples),
                "options": asdict(opts),
                "summary": summary,
            },
            indent=1,
        )
    )
    return summary


def _summarise(path: Path, scan: SplitScan, seconds: float) -> dict:
    from ffcv.reader import Reader

    image = Reader(str(path)).metadata["f0"]
    return {
        "samples": len(scan.samples),
        "classes": len(scan.classes),
        "bytes": path.stat().st_size,
        "source_bytes": sum(os.path.getsize(p) for p, _ in scan.samples),
        "jpg": int((image["mode"] == 0).sum()),
        "raw": int((image["mode"] == 1).sum()),
        "max_side": int(max(image["width"].max(), image["height"].max())),
        "seconds": round(seconds, 2),
    }


def format_summary(split: str, s: dict) -> str:
    """One line: ``train: 245 samples, 2 classes, 23.1 MB (source 46.2 MB, 0.50x), 123 jpg + 122 raw, ...``."""
    return (
        f"{split}: {s['samples']} samples, {s['classes']} classes, {s['bytes'] / 1e6:.1f} MB "
        f"(source {s['source_bytes'] / 1e6:.1f} MB, {s['bytes'] / max(s['source_bytes'], 1):.2f}x), "
        f"{s['jpg']} jpg + {s['raw']} raw, longest side {s['max_side']} px, {s['seconds']:.1f} s"
    )


def add_write_ffcv_command(sub) -> None:
    """Register the ``write-ffcv`` sub-command on ``sub`` (an argparse sub-parsers object)."""
    p = sub.add_parser(
        "write-ffcv",
        help="convert ImageFolder splits into FFCV .ffcv files (needs the ffcv extra)",
        description=__doc__.split("\n\n")[0],
    )
    d = FFCVWriteOptions("", "")
    p.add_argument("--data-dir", required=True, help="ImageFolder root (<data-dir>/<split>/<class>/<image>)")
    p.add_argument("--ffcv-dir", required=True, help="output folder: <ffcv-dir>/<split>.ffcv and <split>.json")
    p.add_argument("--splits", nargs="+", default=d.splits, help="splits to convert (default: train val)")
    p.add_argument(
        "--write-mode",
        choices=WRITE_MODES,
        default=d.write_mode,
        help="raw pixels, JPEG, 'smart' (JPEG when raw is much larger) or 'proportion' (JPEG a "
        "random compress_probability share)",
    )
    p.add_argument(
        "--max-resolution",
        type=int,
        default=d.max_resolution,
        help="longest side in pixels; larger images are downscaled (INTER_AREA)",
    )
    p.add_argument(
        "--compress-probability",
        type=float,
        default=d.compress_probability,
        help="share of images JPEG-compressed in 'proportion' mode",
    )
    p.add_argument("--jpeg-quality", type=int, default=d.jpeg_quality, help="JPEG quality (1-100)")
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="writer processes")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="samples per work item")


def run_write_ffcv(args: argparse.Namespace) -> int:
    """Run ``write-ffcv``; returns 0, or 2 (message on stderr) for a missing extra, bad option or bad data."""
    from trainer.data.formats.ffcv import require_ffcv

    try:
        require_ffcv()
        opts = FFCVWriteOptions(**{k: getattr(args, k) for k in FFCVWriteOptions.__dataclass_fields__}).validate()
        summaries = {s: write_split(opts, s) for s in opts.splits}
    except DataError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    for split, s in summaries.items():
        print("write-ffcv: " + format_summary(split, s), flush=True)
    return 0
