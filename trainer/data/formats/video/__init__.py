"""Video classification data: :mod:`.decode` probes and decodes files with PyAV, :mod:`.clips` picks a clip's
frames, :mod:`.folders` and :mod:`.arrays` are the clip sources (video folder trees; numpy clip arrays),
:mod:`.dataset` holds the dataset keyed by (epoch, index), its collate and the split opener."""

from trainer.data.formats.video.arrays import ArraySource
from trainer.data.formats.video.clips import clip_indices, clip_span
from trainer.data.formats.video.dataset import VideoClipDataset, collate_clips, open_video_split
from trainer.data.formats.video.decode import VIDEO_EXTENSIONS, VideoInfo, fit_frames, probe_video, read_frames
from trainer.data.formats.video.folders import VideoFolderSource, check_same_classes, scan_video_split

__all__ = [
    "VIDEO_EXTENSIONS",
    "ArraySource",
    "VideoClipDataset",
    "VideoFolderSource",
    "VideoInfo",
    "check_same_classes",
    "clip_indices",
    "clip_span",
    "collate_clips",
    "fit_frames",
    "open_video_split",
    "probe_video",
    "read_frames",
    "scan_video_split",
]
