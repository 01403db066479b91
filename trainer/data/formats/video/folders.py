"""Video folders (Kinetics / UCF101 layout): ``<root>/<split>/<class>/<file>.mp4|.avi|.webm|.mkv|.mov``.

Class index = position of the class folder in sorted order; files are sorted within a class. Every file is
probed once at construction (:func:`~.decode.probe_video`, in a thread pool): its frame count is what clip
sampling needs, and a file that cannot be probed is left out, counted and named in :attr:`report`.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from trainer.data.formats.video.clips import clip_span
from trainer.data.formats.video.decode import VIDEO_EXTENSIONS, VideoInfo, probe_video, read_frames
from trainer.errors import DataError


def scan_video_split(root: str | Path, split: str) -> tuple[Path, list[str], list[tuple[str, int]]]:
    """``(split folder, sorted class names, [(path, class index)])`` of ``root/split``.

    Class folders may be symlinks and so may files; folders inside a class folder are walked (not through
    symlinks). Extensions are matched case-insensitively against :data:`~.decode.VIDEO_EXTENSIONS`.

    Raises:
        DataError: ``root/split`` is missing or not a folder, has no class folders, or a class folder holds no
            video file.
    """
    d = Path(root) / split
    if not d.is_dir():
        what = "is a file, not a folder" if d.exists() else "does not exist"
        raise DataError(f"data split '{split}': folder {d} {what} (expected {d}/<class>/<video>)")
    classes = sorted(e.name for e in os.scandir(d) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(f"data split '{split}': {d} has no class sub-folders (expected {d}/<class>/<video>)")
    samples, empty = [], []
    for ci, cls in enumerate(classes):
        n_before = len(samples)
        for dirpath, dirnames, filenames in os.walk(d / cls, followlinks=False):
            dirnames[:] = sorted(x for x in dirnames if not x.startswith("."))
            samples += [
                (os.path.join(dirpath, fn), ci)
                for fn in sorted(filenames)
                if not fn.startswith(".") and os.path.splitext(fn)[1].lower() in VIDEO_EXTENSIONS
            ]
        if len(samples) == n_before:
            empty.append(str(d / cls))
    if empty:
        raise DataError(
            f"data split '{split}': class folder(s) with no videos: {', '.join(empty[:5])}"
            + (f" (+{len(empty) - 5} more)" if len(empty) > 5 else "")
            + f" (extensions read: {' '.join(VIDEO_EXTENSIONS)})"
        )
    return d, classes, samples


def _probe(path: str) -> VideoInfo | str:
    try:
        return probe_video(path)
    except DataError as e:
        return str(e)


def _names(items: list[str]) -> str:
    return "; ".join(items[:5]) + (f"; (+{len(items) - 5} more)" if len(items) > 5 else "")


class VideoFolderSource:
    """Clip source over one split of a video folder tree (the clip-source protocol of ``docs``/the contract).

    Args:
        root: the data folder holding ``<split>/<class>/<video>``.
        split: ``train``, ``val`` ...
        size: side ``S`` of the square frames :meth:`read` returns.
        num_frames, stride: the clip shape (``T`` frames every ``stride``-th); used only by
            ``short_clips="reject"``, which leaves out files shorter than ``(T-1)*stride+1`` frames.
        short_clips: ``"pad"`` (keep short files; clips repeat their last frame) or ``"reject"``.
        max_bad_fraction: largest fraction of the split's files that may fail to probe (they are left out).
        threads: probing threads (file I/O overlaps; 1 probes in this thread).

    Attributes: ``root`` (the split folder), ``classes``, ``paths``, ``labels``, ``frames`` (frame counts),
    ``infos`` (:class:`~.decode.VideoInfo` per kept file), ``bad`` (``[(path, error)]``), ``rejected`` (paths of
    short files left out) and ``report`` (log lines naming them; empty when nothing was left out).

    Raises:
        DataError: layout errors (:func:`scan_video_split`); more than ``max_bad_fraction`` of the files cannot
            be probed, or no file is left (names the first bad files).
    """

    def __init__(
        self,
        root: str | Path,
        split: str,
        size: int,
        *,
        num_frames: int = 32,
        stride: int = 1,
        short_clips: str = "pad",
        max_bad_fraction: float = 0.01,
        threads: int = 8,
    ):
        t0 = time.perf_counter()
        self.root, self.classes, samples = scan_video_split(root, split)
        self.split, self.size = split, size
        paths = [p for p, _ in samples]
        if threads > 1 and len(paths) > 1:
            with ThreadPoolExecutor(max_workers=min(threads, len(paths))) as pool:
                probed = list(pool.map(_probe, paths))
        else:
            probed = [_probe(p) for p in paths]
        self.bad = [(p, r) for p, r in zip(paths, probed) if isinstance(r, str)]
        n = len(samples)
        if len(self.bad) > max_bad_fraction * n or len(self.bad) == n:
            raise DataError(
                f"data split '{split}': {len(self.bad)} of {n} videos in {self.root} cannot be read, more than "
                f"max_bad_fraction={max_bad_fraction}; remove or fix them: {_names([r for _, r in self.bad])}"
            )
        span = clip_span(num_frames, stride)
        keep = [(r, ci) for r, (_, ci) in zip(probed, samples) if not isinstance(r, str)]
        self.rejected = [r.path for r, _ in keep if short_clips == "reject" and r.num_frames < span]
        keep = [(r, ci) for r, ci in keep if not (short_clips == "reject" and r.num_frames < span)]
        if not keep:
            raise DataError(
                f"data split '{split}': none of the {n} videos in {self.root} is long enough for a clip of "
                f"{num_frames} frames at stride {stride} ({span} frames) and short_clips='reject'"
            )
        self.infos = [r for r, _ in keep]
        self.paths = [r.path for r in self.infos]
        self.labels = [ci for _, ci in keep]
        self.frames = [r.num_frames for r in self.infos]
        secs = time.perf_counter() - t0
        self.report: list[str] = []
        if self.bad:
            self.report.append(
                f"data: {split}: {len(self.bad)} of {n} video(s) cannot be read (probed in {secs:.1f} s); "
                f"left out: {_names([r for _, r in self.bad])}"
            )
        if self.rejected:
            self.report.append(
                f"data: {split}: {len(self.rejected)} of {n} video(s) shorter than {span} frames "
                f"(short_clips='reject'); left out: {_names(self.rejected)}"
            )

    def __len__(self) -> int:
        return len(self.paths)

    def label(self, i: int) -> int:
        """Class index of video ``i``."""
        return self.labels[i]

    def num_frames(self, i: int) -> int:
        """Decodable frames of video ``i`` (from the probe)."""
        return self.frames[i]

    def name(self, i: int) -> str:
        """The file path of video ``i`` (for error messages and :class:`~trainer.data.samples.BadSample`)."""
        return self.paths[i]

    def read(self, i: int, frame_indices: list[int]) -> torch.Tensor:
        """uint8 ``(t, 3, S, S)`` frames ``frame_indices`` of video ``i`` (:func:`~.decode.read_frames`).

        Raises:
            DataError: the file cannot be decoded or ends early (names it)."""
        return read_frames(self.paths[i], frame_indices, self.size)


def check_same_classes(train, val) -> None:
    """Raise :class:`DataError` unless two clip sources have the same classes in the same order (same labels).

    The message names both sources and the classes found in only one of them."""
    if list(train.classes) != list(val.classes):
        only_t = sorted(set(train.classes) - set(val.classes))
        only_v = sorted(set(val.classes) - set(train.classes))
        where = f"{getattr(train, 'root', 'train')} and {getattr(val, 'root', 'val')}"
        raise DataError(
            f"train/val class mismatch between {where}: only in train: {only_t or '-'}; only in val: {only_v or '-'}"
        )
