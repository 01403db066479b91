"""Video files with PyAV (FFmpeg): probe a file's frame count and decode chosen frames to square uint8 clips.

Frame ``k`` of a file is the ``k``-th picture the decoder outputs when the file is decoded from its start (the
order a player shows them). Timestamps alone cannot address frames: real files carry wrong ones (the shared
``box.mp4``, written by VLC, has dts = pts on a stream with B-frames and an edit list that drops the 456th
packet; torchcodec, which orders frames by pts, returns other frames than a player shows there). So
:func:`read_frames` decodes from the start and stops after the last frame it needs, and seeks only where the
frame number of a keyframe is certain (:func:`_seek_start`): a stream without frame reordering (no B-frames),
whose demuxer index lists one entry per frame in decode order with strictly increasing timestamps; the first
decoded frame must then carry the keyframe's timestamp, else the file is decoded from the start after all.
Only the frames of the clip are converted to RGB and resized.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch
from torchvision.transforms.v2 import functional as F

from trainer.data.samples import describe_error
from trainer.errors import DataError

#: File extensions scanned as videos (compared lower-case).
VIDEO_EXTENSIONS = (".mp4", ".avi", ".webm", ".mkv", ".mov")


@dataclass(frozen=True)
class VideoInfo:
    """What :func:`probe_video` learns about a file: ``num_frames`` decodable frames, ``fps`` (frames per
    second, the stream's average rate; 0.0 when unknown), ``width`` x ``height`` in pixels of the coded
    picture, ``codec`` the FFmpeg decoder name (``h264``, ``cinepak``, ``msmpeg4`` ...)."""

    path: str
    num_frames: int
    fps: float
    width: int
    height: int
    codec: str


def _mp4_boxes_complete(path: str) -> bool:
    """True when the top-level ISO-BMFF boxes of ``path`` tile the file exactly (no box runs past the end).

    A truncated MP4 whose ``moov`` box comes first still has a header promising every frame; its ``mdat`` box
    then claims more bytes than the file has. Reads one 16-byte box header per top-level box."""
    size = os.path.getsize(path)
    pos = 0
    with open(path, "rb") as f:
        while pos < size:
            f.seek(pos)
            head = f.read(16)
            if len(head) < 8:
                return False
            n = int.from_bytes(head[:4], "big")
            if n == 1:  # 64-bit size follows the type
                if len(head) < 16:
                    return False
                n = int.from_bytes(head[8:16], "big")
            elif n == 0:  # box extends to the end of the file
                return True
            if n < 8:
                return False
            pos += n
    return pos == size


def _header_frames(container, stream, path: str) -> int | None:
    """The stream header's frame count when it can be trusted, else None.

    Trusted only for MP4/MOV (the sample table lists every frame) when the header's count agrees with
    duration x average rate to within half a frame (an edit list that drops frames breaks the agreement, as in
    ``box.mp4``: 456 in the header, 455 decoded) and the file is not truncated. AVI headers are not trusted
    (``tree.avi`` claims 444 frames and holds 68); Matroska/WebM headers carry no count."""
    n = stream.frames
    if n <= 0 or "mp4" not in container.format.name or not stream.duration or not stream.average_rate:
        return None
    expected = Fraction(stream.duration) * stream.time_base * stream.average_rate
    if abs(expected - n) >= Fraction(1, 2) or not _mp4_boxes_complete(path):
        return None
    return int(n)


def _count_packets(container, stream) -> int:
    """Frames of ``stream`` counted by demuxing (no decode): packets with data that the container does not mark
    as discarded (edit lists)."""
    return sum(1 for p in container.demux(stream) if p.size and not p.is_discard)


def _pyav():
    """The ``av`` module (PyAV), imported when a video file is first opened: clip arrays (``.npz``) and the
    feature cache train without it."""
    import av

    return av


def probe_video(path: str | Path) -> VideoInfo:
    """Open ``path`` and describe its first video stream (see :class:`VideoInfo`).

    The frame count comes from the header when :func:`_header_frames` trusts it, else from demuxing every
    packet (reads the file, decodes nothing: about 1 ms per MB from the page cache).

    Raises:
        DataError: (one line naming the file) the file is not a video FFmpeg can open (text, empty, truncated
            header, a still image), has no video stream, has zero frames, or its codec has no decoder in PyAV.
    """
    p = str(path)
    av = _pyav()
    try:
        with av.open(p, metadata_errors="ignore") as c:
            if c.format.name.endswith("_pipe") or c.format.name == "image2":
                raise DataError(f"{p}: a still image ({c.format.name}), not a video")
            if not c.streams.video:
                kinds = ", ".join(s.type for s in c.streams) or "none"
                raise DataError(f"{p}: no video stream (streams: {kinds})")
            s = c.streams.video[0]
            cc = s.codec_context
            if cc is None:
                raise DataError(f"{p}: the video stream's codec has no decoder in PyAV {av.__version__} (FFmpeg)")
            n = _header_frames(c, s, p)
            if n is None:
                n = _count_packets(c, s)
            fps = float(s.average_rate or s.guessed_rate or 0.0)
            info = VideoInfo(p, n, fps, int(cc.width), int(cc.height), cc.name)
    except DataError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise DataError(f"{p}: not a readable video ({describe_error(e)})") from None
    if info.num_frames <= 0:
        raise DataError(f"{p}: the video stream has zero frames")
    if info.width <= 0 or info.height <= 0:
        raise DataError(f"{p}: the video stream has no picture size ({info.width}x{info.height})")
    return info


def fit_frames(frames: torch.Tensor, size: int) -> torch.Tensor:
    """Resize uint8 ``(..., 3, H, W)`` frames so the shorter side is ``size`` (bilinear, antialiased: torchvision
    v2 ``resize``) and cut the centre ``size x size``: uint8 ``(..., 3, size, size)``."""
    if min(frames.shape[-2:]) != size:
        frames = F.resize(frames, size, antialias=True)
    if tuple(frames.shape[-2:]) != (size, size):
        frames = F.center_crop(frames, [size, size])
    return frames


def _check_indices(path: str, indices: list[int]) -> None:
    if not indices:
        raise ValueError(f"{path}: no frame indices asked for")
    if indices[0] < 0 or any(b < a for a, b in zip(indices, indices[1:])):
        raise ValueError(f"{path}: frame indices must be >= 0 and non-decreasing, got {indices}")


#: Seek only when the clip starts at least this many frames after the keyframe before it would save.
SEEK_MIN_FRAMES = 16


def _seek_start(container, stream, first: int, last: int) -> int:
    """Seek ``container`` to the keyframe at or before frame ``first`` when that keyframe's frame number is
    certain (see the module docstring) and saves at least :data:`SEEK_MIN_FRAMES` frames; returns its frame
    number (0: no seek, decode from the start)."""
    cc = stream.codec_context
    if first < SEEK_MIN_FRAMES or cc.has_b_frames:
        return 0
    entries = stream.index_entries
    if len(entries) <= last or any(e.is_discard for e in entries[: last + 1]):
        return 0
    ts = [e.timestamp for e in entries[: first + 1]]
    if any(b <= a for a, b in zip(ts, ts[1:])):
        return 0
    key = next((j for j in range(first, -1, -1) if entries[j].is_keyframe), 0)
    if key < SEEK_MIN_FRAMES:
        return 0
    container.seek(ts[key], stream=stream, backward=True, any_frame=False)
    return key


def read_frames(path: str | Path, indices: list[int], size: int, *, threads: int = 1) -> torch.Tensor:
    """Frames ``indices`` of ``path`` (decode order, counted from 0; non-decreasing, repeats allowed: padding) as
    uint8 ``(len(indices), 3, size, size)`` RGB, each resized (shorter side to ``size``, antialiased) and
    centre-cropped (:func:`fit_frames`).

    Decodes from the start (or from a keyframe whose frame number is certain: module docstring) and stops
    after ``indices[-1]``; only the wanted frames are converted
    (``to_ndarray(format="rgb24")``) and resized. ``threads``: FFmpeg decoder threads; 1 (default) suits
    DataLoader workers, whose parallelism is the workers themselves; 0 lets FFmpeg pick (frame + slice
    threads, ``thread_type="AUTO"``). See ``benchmarks/video_decoders.py``.

    Raises:
        ValueError: ``indices`` empty, negative or decreasing (a caller bug).
        DataError: (names the file) it cannot be opened or decoded, or it ends before ``indices[-1]``.
    """
    p, idx = str(path), [int(i) for i in indices]
    _check_indices(p, idx)
    out = _decode(p, idx, size, threads, seek=True)
    if out is None:  # the seek landed on another frame than the index promised: decode from the start
        out = _decode(p, idx, size, threads, seek=False)
    return out


def _decode(p: str, idx: list[int], size: int, threads: int, seek: bool) -> torch.Tensor | None:
    """:func:`read_frames`' decode loop; None when ``seek`` found the first frame after a seek not where the
    demuxer index put it."""
    out: list[torch.Tensor] = []
    k = -1
    av = _pyav()
    try:
        with av.open(p, metadata_errors="ignore") as c:
            if not c.streams.video:
                raise DataError(f"{p}: no video stream")
            s = c.streams.video[0]
            if threads == 1:
                s.thread_count = 1
            else:
                s.thread_type = "AUTO"
                s.thread_count = max(0, threads)
            j, start = 0, (_seek_start(c, s, idx[0], idx[-1]) if seek else 0)
            frames = c.decode(s)
            if start:
                first = next(frames, None)
                if first is None or first.pts != s.index_entries[start].timestamp:
                    return None
                frames = itertools.chain([first], frames)
            k = start - 1
            for k, frame in enumerate(frames, start):
                if k < idx[j]:
                    continue
                t = fit_frames(torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1), size)
                while j < len(idx) and idx[j] == k:
                    out.append(t)
                    j += 1
                if j == len(idx):
                    break
    except DataError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise DataError(f"{p}: decoding failed after frame {k} ({describe_error(e)})") from None
    if len(out) < len(idx):
        raise DataError(f"{p}: the video ends after {k + 1} frame(s); the clip needs frame {idx[-1]}")
    return torch.stack(out).contiguous()
