"""Video clip samples: the map-style dataset over a clip source, its collate, and the split opener.

A *clip source* (:class:`~.folders.VideoFolderSource`, :class:`~.arrays.ArraySource`, or a cached-feature
source) has ``len()``, ``label(i)``, ``num_frames(i)``, ``name(i)``, ``classes`` and ``read(i, frame_indices)``
-> uint8 (t, 3, S, S) frames (or float (t, D) features). Everything random about a sample (its window, its
flip) is a pure function of (seed, epoch, index), so a resumed run sees bit-identical batches.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from trainer.data.formats.video.arrays import ArraySource
from trainer.data.formats.video.clips import CLIP_MODES, SHORT_CLIP_RULES, clip_indices, clip_span
from trainer.data.formats.video.folders import VideoFolderSource
from trainer.data.samples import BadSample, decode_or_replace, describe_error, sample_seed
from trainer.errors import ConfigError, DataError

#: Added to the sample seed for the flip draw, so the flip and the window start use unrelated streams.
_FLIP_SALT = 0x5F1F


class VideoClipDataset(Dataset):
    """Clips of ``num_frames`` frames every ``stride``-th frame from a clip source, keyed by ``(epoch, index)``
    (a plain index is epoch 0), as :class:`trainer.data.sampler.EpochSampler` yields them.

    ``ds[(epoch, index)]`` returns ``(clip, label, own_bad)``: ``clip`` is what ``source.read`` returns for
    :func:`~.clips.clip_indices` ``(num_frames(i), num_frames, stride, mode, sample_seed(seed, epoch, i),
    short_clips)`` - uint8 (T, 3, S, S) frames, flipped left-right with probability ``hflip_prob`` (only 4-D uint8
    frames; feature rows are never flipped) - ``label`` an int, ``own_bad`` ``(BadSample,)`` when this index's
    file was bad and replaced by the next good one (training, ``replace_bad`` True), else ``()``. A file that
    cannot be read, or is too short under ``short_clips="reject"``, is a :class:`BadSample`; in evaluation
    (``replace_bad`` False) the dataset returns it and :func:`collate_clips` drops it.

    The window is drawn with ``random.Random(sample_seed(seed, epoch, i))`` of the index actually read; the flip
    with a ``torch.Generator`` seeded from the sample's own (epoch, index). Picklable (DataLoader workers): it
    holds the source's file names and arrays, never an open container.

    Raises:
        ValueError: unknown ``mode`` or ``short_clips``, ``num_frames`` or ``stride`` < 1.
        DataError: ``MAX_REPLACEMENTS`` consecutive files are bad (names the first).
    """

    MAX_REPLACEMENTS = 16

    def __init__(
        self,
        source,
        num_frames: int,
        stride: int = 1,
        mode: str = "uniform",
        seed: int = 0,
        short_clips: str = "pad",
        hflip_prob: float = 0.0,
        replace_bad: bool = True,
    ):
        if mode not in CLIP_MODES or short_clips not in SHORT_CLIP_RULES or num_frames < 1 or stride < 1:
            raise ValueError(
                f"VideoClipDataset: mode {mode!r} (one of {CLIP_MODES}), short_clips {short_clips!r} "
                f"(one of {SHORT_CLIP_RULES}), num_frames {num_frames} and stride {stride} (>= 1)"
            )
        self.source, self.num_frames, self.stride, self.mode = source, num_frames, stride, mode
        self.seed, self.short_clips, self.hflip_prob, self.replace_bad = seed, short_clips, hflip_prob, replace_bad

    def __len__(self) -> int:
        return len(self.source)

    def frame_indices(self, epoch: int, index: int) -> list[int] | None:
        """The frames sample ``index`` reads in ``epoch`` (None: too short and ``short_clips="reject"``)."""
        n = self.source.num_frames(index)
        rng_seed = sample_seed(self.seed, epoch, index)
        return clip_indices(n, self.num_frames, self.stride, self.mode, rng_seed, self.short_clips)

    def decode(self, epoch: int, index: int) -> torch.Tensor | BadSample:
        """The unflipped clip of sample ``index`` in ``epoch``, or a :class:`BadSample` naming its file."""
        try:
            idx = self.frame_indices(epoch, index)
            if idx is None:
                n, span = self.source.num_frames(index), clip_span(self.num_frames, self.stride)
                return BadSample(self.source.name(index), f"ShortClip: {n} frames, a clip spans {span}")
            return self.source.read(index, idx)
        except Exception as e:  # noqa: BLE001 - corrupt, truncated, unsupported: skip, count, report
            return BadSample(self.source.name(index), describe_error(e))

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        if self.replace_bad:
            clip, used, own = decode_or_replace(
                lambda i: self.decode(epoch, i), index, len(self.source), self.MAX_REPLACEMENTS
            )
        else:
            clip, used, own = self.decode(epoch, index), index, ()
            if isinstance(clip, BadSample):
                return clip
        if self.hflip_prob > 0 and clip.ndim == 4 and clip.dtype == torch.uint8:
            g = torch.Generator().manual_seed(sample_seed(self.seed + _FLIP_SALT, epoch, index))
            if float(torch.rand((), generator=g)) < self.hflip_prob:
                clip = clip.flip(-1)
        return clip, self.source.label(used), own


def collate_clips(items: list) -> dict:
    """Stack :class:`VideoClipDataset` items; list the replaced (training) or dropped (evaluation) files.

    Returns ``{"clip": uint8 (B, T, 3, S, S), "label": int64 (B,), "bad": [BadSample, ...]}``, or with
    ``"features"`` float (B, T, D) instead of ``"clip"`` when the items are 2-D feature rows. A batch whose items
    are all bad gives ``"clip"`` uint8 (0, 1, 3, 1, 1) and ``"label"`` (0,).
    """
    good = [it for it in items if not isinstance(it, BadSample)]
    bad = [it for it in items if isinstance(it, BadSample)] + [b for g in good for b in g[2]]
    if not good:
        return {
            "clip": torch.empty((0, 1, 3, 1, 1), dtype=torch.uint8),
            "label": torch.empty((0,), dtype=torch.int64),
            "bad": bad,
        }
    x = torch.stack([g[0] for g in good])
    labels = torch.tensor([g[1] for g in good], dtype=torch.int64)
    return {"features" if x.ndim == 3 else "clip": x, "label": labels, "bad": bad}


def open_video_split(cfg, split: str, image_size: int):
    """The clip source of ``split`` as the config asks: ``cfg.video_format`` ``"folders"`` ->
    :class:`~.folders.VideoFolderSource` over ``cfg.data_dir/<split>/<class>/<video>``; ``"arrays"`` ->
    :class:`~.arrays.ArraySource` over ``cfg.data_dir/<split>.npz`` when it exists, else the
    ``cfg.data_dir/<split>_clips.npy`` + ``<split>_labels.npy`` pair. Attributes read with defaults
    (``num_frames`` 32, ``frame_stride`` 1, ``short_clips`` "pad", ``max_bad_fraction`` 0.01), so any object
    with ``data_dir`` works.

    Raises:
        ConfigError: unknown ``video_format``.
        DataError: the split's files are missing or invalid (see the sources); with ``short_clips="reject"``,
            stored array clips shorter than a clip's span.
    """
    fmt = getattr(cfg, "video_format", "folders")
    data_dir = Path(cfg.data_dir)
    T, stride = int(getattr(cfg, "num_frames", 32)), int(getattr(cfg, "frame_stride", 1))
    short = getattr(cfg, "short_clips", "pad")
    if fmt == "folders":
        return VideoFolderSource(
            data_dir,
            split,
            image_size,
            num_frames=T,
            stride=stride,
            short_clips=short,
            max_bad_fraction=float(getattr(cfg, "max_bad_fraction", 0.01)),
        )
    if fmt == "arrays":
        npz = data_dir / f"{split}.npz"
        src = ArraySource(npz if npz.is_file() else data_dir, split, image_size)
        if short == "reject" and src.clip_shape[0] < clip_span(T, stride):
            raise DataError(
                f"{src.clips_file}: clips have {src.clip_shape[0]} frames, fewer than a clip of {T} frames at "
                f"stride {stride} spans ({clip_span(T, stride)}), and short_clips='reject'"
            )
        return src
    raise ConfigError(f"video_format: {fmt!r} is not one of 'folders', 'arrays'")
