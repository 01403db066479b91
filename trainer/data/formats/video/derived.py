"""Labelled clip sets derived from unlabelled videos, written in the arrays format (``<split>.npz``): sanity checks of
a video pipeline on any footage (tests, ``benchmarks/video_tasks.py``).

* **clip source** — class = the video a window comes from. Each video is split by time: the first
  ``train_fraction`` of its frames give the training windows, the rest the validation windows, and windows never
  overlap (each other, or the split point), so validation shows unseen moments of the same scenes.
* **arrow of time** — class = ``forward`` or ``backward``: every window once in playback order and once reversed
  (the same frames, so a model that ignores frame order is at chance: 50 %). Split by time as above.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trainer.data.formats.video.decode import probe_video, read_frames


def window_starts(num_frames: int, span: int, train_fraction: float) -> dict[str, list[int]]:
    """Start frames of non-overlapping windows of ``span`` frames: ``{"train": [...], "val": [...]}``, training
    windows inside the first ``floor(num_frames * train_fraction)`` frames, validation windows after them."""
    cut = int(num_frames * train_fraction)
    return {
        "train": list(range(0, cut - span + 1, span)),
        "val": list(range(cut, num_frames - span + 1, span)),
    }


def _decode_all(path: str, size: int) -> torch.Tensor:
    """Every frame of ``path`` as uint8 (n, S, S, 3) (the arrays format's layout)."""
    n = probe_video(path).num_frames
    return read_frames(path, list(range(n)), size).permute(0, 2, 3, 1).contiguous()


def _windows(frames: torch.Tensor, starts: list[int], num_frames: int, stride: int) -> list[torch.Tensor]:
    return [frames[s : s + (num_frames - 1) * stride + 1 : stride] for s in starts]


def _save(out: Path, split: str, clips: list[torch.Tensor], labels: list[int], classes: list[str]) -> int:
    np.savez(
        out / f"{split}.npz",
        clips=torch.stack(clips).numpy(),
        labels=np.asarray(labels, dtype=np.int64),
        classes=np.asarray(classes),
    )
    return len(clips)


def write_clip_sets(
    videos: list[str | Path],
    out_dir: str | Path,
    *,
    num_frames: int = 8,
    stride: int = 2,
    size: int = 32,
    train_fraction: float = 0.7,
) -> dict[str, dict[str, int]]:
    """Decode each video once (frames resized to ``size``, centre-cropped) and write both sets:
    ``<out_dir>/clip-source/{train,val}.npz`` and ``<out_dir>/arrow-of-time/{train,val}.npz`` (clips uint8
    (N, num_frames, size, size, 3), labels int64 (N,), classes). Returns the clip counts per set and split.

    Raises:
        DataError: a video cannot be probed or decoded (from the decoder, naming the file).
    """
    out = Path(out_dir)
    span = (num_frames - 1) * stride + 1
    source: dict[str, tuple[list, list]] = {"train": ([], []), "val": ([], [])}
    arrow: dict[str, tuple[list, list]] = {"train": ([], []), "val": ([], [])}
    names = [Path(v).stem for v in videos]
    for label, video in enumerate(videos):
        frames = _decode_all(str(video), size)
        for split, starts in window_starts(len(frames), span, train_fraction).items():
            for w in _windows(frames, starts, num_frames, stride):
                source[split][0].append(w)
                source[split][1].append(label)
                arrow[split][0].extend([w, w.flip(0)])
                arrow[split][1].extend([0, 1])
    counts: dict[str, dict[str, int]] = {}
    for name, sets, classes in (("clip-source", source, names), ("arrow-of-time", arrow, ["forward", "backward"])):
        (out / name).mkdir(parents=True, exist_ok=True)
        counts[name] = {split: _save(out / name, split, *sets[split], classes) for split in ("train", "val")}
    return counts
