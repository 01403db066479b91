"""The video data layer (trainer/data/formats/video): probing and decoding the shared real clips with PyAV, clip
sampling, the folder and array sources, bad inputs, the dataset's determinism and the collate."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch

from trainer.data.formats.video import (
    ArraySource,
    VideoClipDataset,
    VideoFolderSource,
    check_same_classes,
    clip_indices,
    collate_clips,
    fit_frames,
    open_video_split,
    probe_video,
    read_frames,
)
from trainer.data.samples import BadSample
from trainer.errors import ConfigError, DataError

# Frame counts and codecs from ../shared/data/README.md (decoded counts: box.mp4's header says 456 and
# tree.avi's 444; the probe must give the decoded numbers).
CLIPS = {
    "bigbuckbunny.mp4": (132, "h264"),
    "bikes.mp4": (250, "h264"),
    "carphone_pristine.mp4": (120, "h264"),
    "box.mp4": (455, "h264"),
    "cup.mp4": (217, "h264"),
    "tree.avi": (68, "cinepak"),
    "vtest.avi": (795, "msmpeg4"),
}


@pytest.fixture(scope="module")
def clips_dir(shared_data) -> Path:
    d = shared_data / "video-clips"
    assert d.is_dir(), f"{d} missing: the shared data must include video-clips"
    return d


def _reference(path: Path, size: int) -> torch.Tensor:
    """Every frame by a plain sequential PyAV decode, resized like the readers: uint8 (n, 3, size, size)."""
    with av.open(str(path)) as c:
        frames = [
            fit_frames(torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1), size) for f in c.decode(video=0)
        ]
    return torch.stack(frames)


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_every_shared_clip_probes_and_decodes(clips_dir, name):
    n, codec = CLIPS[name]
    info = probe_video(clips_dir / name)
    assert (info.num_frames, info.codec) == (n, codec)
    assert info.width > 0 and info.height > 0 and info.fps > 0
    frames = read_frames(clips_dir / name, list(range(n)), 16)
    assert frames.shape == (n, 3, 16, 16) and frames.dtype == torch.uint8
    with pytest.raises(DataError, match=f"{name}: the video ends after {n} frame"):
        read_frames(clips_dir / name, [0, n], 16)


@pytest.mark.parametrize("name", ["box.mp4", "tree.avi", "bikes.mp4", "cup.mp4", "vtest.avi"])
def test_read_frames_returns_exactly_the_asked_frames(clips_dir, name):
    ref = _reference(clips_dir / name, 24)
    n = CLIPS[name][0]
    windows = [[0, 0, 1, 7, 7, 30, n // 2, n - 2, n - 1, n - 1], list(range(n - 15, n, 2))]
    windows += [clip_indices(n, 8, 2, "random", seed) for seed in range(4)]
    for idx in windows:
        assert torch.equal(read_frames(clips_dir / name, idx, 24), ref[idx]), idx
    assert torch.equal(read_frames(clips_dir / name, [n - 5], 24, threads=0), ref[[n - 5]])


def test_a_seek_that_lands_elsewhere_falls_back_to_decoding_from_the_start(clips_dir, monkeypatch):
    import trainer.data.formats.video.decode as decode

    calls = []

    def lying_seek(container, stream, first, last):  # seeks to the keyframe at 60, claims 30
        calls.append(first)
        container.seek(stream.index_entries[60].timestamp, stream=stream, backward=True)
        return 30

    path = clips_dir / "cup.mp4"  # keyframes every 30 frames, no B-frames: read_frames would seek
    want = read_frames(path, [70, 72], 24)
    monkeypatch.setattr(decode, "_seek_start", lying_seek)
    assert torch.equal(read_frames(path, [70, 72], 24), want) and calls == [70]


def test_read_frames_rejects_unsorted_or_empty_indices(clips_dir):
    for bad in ([], [3, 2], [-1, 0]):
        with pytest.raises(ValueError, match="bikes.mp4"):
            read_frames(clips_dir / "bikes.mp4", bad, 16)


def test_fit_frames_resizes_the_shorter_side_and_crops_the_centre():
    x = torch.zeros((2, 3, 20, 40), dtype=torch.uint8)
    x[..., 10:30] = 255  # the centre 20 columns
    y = fit_frames(x, 10)
    assert y.shape == (2, 3, 10, 10) and y.dtype == torch.uint8
    assert int(y[..., 1:-1].min()) == 255 and int(y.min()) > 200  # antialiasing blurs only the edge columns


def test_clip_indices_windows_padding_and_reject():
    assert clip_indices(100, 4, 3, "uniform") == [45, 48, 51, 54]  # span 10, centred
    assert clip_indices(10, 4, 3, "uniform") == [0, 3, 6, 9]
    for seed in range(20):
        a = clip_indices(100, 8, 2, "random", seed)
        assert a == clip_indices(100, 8, 2, "random", seed)  # pure
        assert a[0] >= 0 and a[-1] <= 99 and all(b - c == 2 for b, c in zip(a[1:], a))
    assert len({clip_indices(100, 8, 2, "random", s)[0] for s in range(20)}) > 5
    assert clip_indices(5, 4, 2, "random", 7) == [0, 2, 4, 4]  # short: what exists at that stride, padded
    assert clip_indices(1, 3, 1, "uniform") == [0, 0, 0]
    assert clip_indices(5, 4, 2, "uniform", short_clips="reject") is None
    for kwargs in ({"mode": "middle"}, {"short_clips": "loop"}):
        with pytest.raises(ValueError):
            clip_indices(10, 4, 1, **kwargs)
    with pytest.raises(ValueError):
        clip_indices(0, 4, 1)


# .. bad inputs ...........................................................................................


def _audio_only(p: Path) -> None:
    with av.open(str(p), "w") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in s.encode(frame):
            c.mux(packet)
        for packet in s.encode(None):
            c.mux(packet)


def _no_decoder(p: Path, clips: Path) -> None:
    p.write_bytes((clips / "tree.avi").read_bytes().replace(b"cvid", b"zzzz"))


def _cut(src: Path, p: Path) -> None:
    data = src.read_bytes()
    p.write_bytes(data[: len(data) // 2])


VIDEO_CASES = [
    ("text-renamed-mp4", "notes.mp4", lambda p, c: p.write_text("hello\n" * 100), "not a readable video"),
    ("empty-file", "empty.mp4", lambda p, c: p.write_bytes(b""), "not a readable video"),
    ("truncated-mp4-moov-last", "cut.mp4", lambda p, c: _cut(c / "bikes.mp4", p), "not a readable video"),
    ("audio-only", "sound.mkv", lambda p, c: _audio_only(p), "no video stream"),
    ("still-image", "photo.mp4", lambda p, c: p.write_bytes(_jpeg()), "a still image"),
    ("unknown-codec", "odd.avi", _no_decoder, "has no decoder in PyAV"),
]


def _jpeg() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("case", VIDEO_CASES, ids=lambda c: c[0])
def test_bad_video_files_raise_one_line_naming_the_file(tmp_path, clips_dir, case):
    _, fname, make, fragment = case
    p = tmp_path / fname
    make(p, clips_dir)
    with pytest.raises(DataError) as e:
        probe_video(p)
    assert fname in str(e.value) and fragment in str(e.value) and "\n" not in str(e.value)


def test_truncated_mp4_with_header_first_probes_to_what_is_left(tmp_path, clips_dir):
    p = tmp_path / "cup_cut.mp4"  # cup.mp4's moov comes first: the header still promises 217 frames
    _cut(clips_dir / "cup.mp4", p)
    n = probe_video(p).num_frames
    assert 0 < n < 217
    assert read_frames(p, list(range(n)), 16).shape[0] == n


def _npz(path: Path, clips, labels, **extra) -> Path:
    np.savez(path, clips=clips, labels=labels, **extra)
    return path


def _good(n=4, t=6, h=20, w=30) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, t, h, w, 3), dtype=np.uint8), np.arange(n) % 2


ARRAY_CASES = [
    ("wrong-rank", lambda: (_good()[0][0], _good()[1]), {}, "rank 4"),
    ("wrong-dtype", lambda: (_good()[0].astype(np.float32), _good()[1]), {}, "dtype float32, expected uint8"),
    ("not-rgb", lambda: (_good()[0][..., :1], _good()[1]), {}, "expected C=3"),
    ("empty", lambda: (_good()[0][:0], _good()[1][:0]), {}, "empty"),
    ("labels-length", lambda: (_good()[0], _good()[1][:3]), {}, "labels have shape (3,), expected (4,)"),
    ("labels-float", lambda: (_good()[0], _good()[1].astype(np.float32)), {}, "expected an integer dtype"),
    ("label-negative", lambda: (_good()[0], np.array([0, 1, -1, 0])), {}, "label -1 is negative"),
    ("label-out-of-range", lambda: (_good()[0], np.array([0, 1, 2, 0])), {"classes": ["a", "b"]}, "out of range"),
]


@pytest.mark.parametrize("case", ARRAY_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("layout", ["npz", "npy"])
def test_bad_arrays_raise_naming_file_and_key(tmp_path, case, layout):
    _, make, extra, fragment = case
    clips, labels = make()
    if layout == "npz":
        path = _npz(tmp_path / "train.npz", clips, labels, **extra)
        name = "train.npz"
    else:
        np.save(tmp_path / "train_clips.npy", clips)
        np.save(tmp_path / "train_labels.npy", labels)
        if "classes" in extra:
            (tmp_path / "classes.txt").write_text("\n".join(extra["classes"]) + "\n")
        path, name = tmp_path, "train_labels.npy" if "label" in case[0] else "train_clips.npy"
    with pytest.raises(DataError) as e:
        ArraySource(path, "train", 16)
    msg = str(e.value)
    assert name in msg and fragment in msg and "\n" not in msg


def test_missing_array_files_and_keys_are_named(tmp_path):
    with pytest.raises(DataError, match="val_clips.npy does not exist"):
        ArraySource(tmp_path, "val", 16)
    np.savez(tmp_path / "val.npz", labels=np.zeros(2, dtype=np.int64))
    with pytest.raises(DataError, match=r"val.npz: no key 'clips' \(keys: labels\)"):
        ArraySource(tmp_path / "val.npz", "val", 16)
    np.savez(tmp_path / "train.npz", clips=np.zeros((2, 4, 8, 8, 3), dtype=np.uint8))  # was a KeyError
    with pytest.raises(DataError, match=r"train.npz: no key 'labels' \(keys: clips\)"):
        ArraySource(tmp_path / "train.npz", "train", 16)


# .. sources ..............................................................................................


def _tree(root: Path, clips: Path, layout: dict[str, list[str]]) -> Path:
    """``root/<class>/<link>`` symlinks to the shared clips (``layout``: class -> [clip name or 'link=clip'])."""
    for cls, names in layout.items():
        (root / cls).mkdir(parents=True)
        for n in names:
            link, _, target = n.partition("=")
            (root / cls / link).symlink_to(clips / (target or link))
    return root


def test_folder_source_scans_probes_and_reports(tmp_path, clips_dir):
    _tree(tmp_path / "train", clips_dir, {"b": ["tree.avi", "vtest.avi"], "a": ["bikes.mp4", "CUP.MP4=cup.mp4"]})
    (tmp_path / "train" / "b" / "broken.mp4").write_text("not a video")
    (tmp_path / "train" / "a" / "notes.txt").write_text("ignored")
    src = VideoFolderSource(tmp_path, "train", 32, max_bad_fraction=0.5)
    assert src.classes == ["a", "b"]
    assert [Path(src.name(i)).name for i in range(len(src))] == ["CUP.MP4", "bikes.mp4", "tree.avi", "vtest.avi"]
    assert [src.label(i) for i in range(4)] == [0, 0, 1, 1]
    assert [src.num_frames(i) for i in range(4)] == [217, 250, 68, 795]
    assert len(src.bad) == 1 and len(src.report) == 1 and "broken.mp4" in src.report[0]
    assert src.read(2, [0, 67]).shape == (2, 3, 32, 32)
    single = VideoFolderSource(tmp_path, "train", 32, max_bad_fraction=0.5, threads=1)
    assert single.paths == src.paths and single.frames == src.frames
    with pytest.raises(DataError, match=r"1 of 5 videos .* cannot be read, more than max_bad_fraction=0.1.*broken"):
        VideoFolderSource(tmp_path, "train", 32, max_bad_fraction=0.1)
    short = VideoFolderSource(tmp_path, "train", 32, num_frames=40, stride=2, short_clips="reject", max_bad_fraction=1)
    assert "tree.avi" not in " ".join(short.paths) and len(short) == 3
    assert any("shorter than 79 frames" in line and "tree.avi" in line for line in short.report)


def test_folder_layout_errors_and_class_mismatch(tmp_path, clips_dir):
    with pytest.raises(DataError, match="does not exist"):
        VideoFolderSource(tmp_path, "train", 16)
    (tmp_path / "train").mkdir()
    with pytest.raises(DataError, match="has no class sub-folders"):
        VideoFolderSource(tmp_path, "train", 16)
    (tmp_path / "train" / "empty").mkdir()
    with pytest.raises(DataError, match="class folder.* with no videos"):
        VideoFolderSource(tmp_path, "train", 16)
    _tree(tmp_path / "val", clips_dir, {"a": ["tree.avi"], "c": ["carphone_pristine.mp4"]})
    _tree(tmp_path / "t2", clips_dir, {"a": ["tree.avi"], "b": ["carphone_pristine.mp4"]})
    val, t2 = VideoFolderSource(tmp_path, "val", 16), VideoFolderSource(tmp_path, "t2", 16)
    with pytest.raises(DataError, match=r"only in train: \['b'\]; only in val: \['c'\]"):
        check_same_classes(t2, val)


def test_compressed_npz_is_decompressed_per_process(tmp_path):
    clips, labels = _good()
    np.savez_compressed(tmp_path / "train.npz", clips=clips, labels=labels)
    a = ArraySource(tmp_path / "train.npz", "train", 16)
    assert a.resident_bytes == clips.nbytes and not isinstance(a.clips, np.memmap)
    assert (a.clips[1] == clips[1]).all()


def test_array_sources_npz_and_memmapped_npy_agree(tmp_path):
    clips, labels = _good()
    _npz(tmp_path / "train.npz", clips, labels, classes=np.asarray(["x", "y"]))
    np.save(tmp_path / "train_clips.npy", clips)
    np.save(tmp_path / "train_labels.npy", labels)
    (tmp_path / "classes.txt").write_text("x\ny\n")
    a, b = ArraySource(tmp_path / "train.npz", "train", 16), ArraySource(tmp_path, "train", 16)
    assert a.classes == b.classes == ["x", "y"] and len(a) == len(b) == 4 and a.num_frames(0) == 6
    assert a.resident_bytes == 0 and b.resident_bytes == 0 and a.file_bytes > 0 and b.file_bytes > 0
    assert isinstance(b.clips, np.memmap) and isinstance(a.clips, np.memmap)  # np.savez stores: mapped in place
    want = fit_frames(torch.from_numpy(clips[1, [0, 2, 2]]).permute(0, 3, 1, 2), 16)
    assert torch.equal(a.read(1, [0, 2, 2]), want) and torch.equal(b.read(1, [0, 2, 2]), want)
    assert a.name(3).endswith("train.npz[3]") and [a.label(i) for i in range(4)] == [0, 1, 0, 1]
    c = pickle.loads(pickle.dumps(b))
    assert c._arr is None and torch.equal(c.read(1, [0, 2, 2]), want)
    with pytest.raises(DataError, match=r"train_clips.npy\[0\]: frame indices"):
        b.read(0, [0, 6])


def test_array_source_resizes_like_the_folder_source(tmp_path, clips_dir):
    with av.open(str(clips_dir / "bikes.mp4")) as c:
        frames = [f.to_ndarray(format="rgb24") for _, f in zip(range(3), c.decode(video=0))]
    _npz(tmp_path / "train.npz", np.stack(frames)[None], np.array([0]))
    arr = ArraySource(tmp_path / "train.npz", "train", 32)
    assert torch.equal(arr.read(0, [0, 2]), read_frames(clips_dir / "bikes.mp4", [0, 2], 32))


# .. dataset, collate, split opener ........................................................................


@pytest.fixture
def folder_source(tmp_path, clips_dir):
    _tree(tmp_path / "train", clips_dir, {"a": ["tree.avi", "carphone_pristine.mp4"], "b": ["bikes.mp4"]})
    return VideoFolderSource(tmp_path, "train", 24)


def test_dataset_is_a_pure_function_of_epoch_and_index(folder_source):
    ds = VideoClipDataset(folder_source, 8, 2, "random", seed=3, hflip_prob=0.5)
    x, label, own = ds[(0, 2)]
    assert x.shape == (8, 3, 24, 24) and x.dtype == torch.uint8 and label == 1 and own == ()
    assert torch.equal(ds[(0, 2)][0], x)
    again = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker gets
    assert torch.equal(again[(0, 2)][0], x)
    starts = {ds.frame_indices(e, 2)[0] for e in range(8)}
    assert len(starts) > 1  # another epoch, another window
    assert any(not torch.equal(ds[(e, 2)][0], x) for e in range(1, 4))
    flipped = VideoClipDataset(folder_source, 8, 2, "random", seed=3, hflip_prob=1.0)[(0, 2)][0]
    plain = VideoClipDataset(folder_source, 8, 2, "random", seed=3, hflip_prob=0.0)[(0, 2)][0]
    assert torch.equal(flipped, plain.flip(-1))
    uniform = VideoClipDataset(folder_source, 8, 2, "uniform")
    assert uniform.frame_indices(0, 2) == uniform.frame_indices(5, 2) == list(range(117, 133, 2))


class _FlakySource:
    """A clip source whose clip 1 cannot be decoded."""

    classes = ["a", "b"]

    def __len__(self):
        return 3

    def label(self, i):
        return i % 2

    def num_frames(self, i):
        return 10

    def name(self, i):
        return f"clip{i}.mp4"

    def read(self, i, idx):
        if i == 1:
            raise DataError(f"clip{i}.mp4: decoding failed")
        return torch.full((len(idx), 3, 4, 4), i, dtype=torch.uint8)


def test_bad_clips_are_replaced_in_training_and_dropped_in_evaluation():
    train = VideoClipDataset(_FlakySource(), 4, 1, "random", replace_bad=True)
    x, label, own = train[(0, 1)]
    assert int(x[0, 0, 0, 0]) == 2 and label == 0 and own == (BadSample("clip1.mp4", own[0].error),)
    assert "decoding failed" in own[0].error
    val = VideoClipDataset(_FlakySource(), 4, 1, "uniform", replace_bad=False)
    batch = collate_clips([val[i] for i in range(3)])
    assert batch["clip"].shape == (2, 4, 3, 4, 4) and batch["label"].tolist() == [0, 0]
    assert [b.path for b in batch["bad"]] == ["clip1.mp4"]
    short = VideoClipDataset(_FlakySource(), 11, 1, "uniform", short_clips="reject", replace_bad=False)
    assert isinstance(short[0], BadSample) and "ShortClip" in short[0].error


def test_collate_shapes():
    items = [(torch.zeros((4, 3, 8, 8), dtype=torch.uint8), i, ()) for i in range(3)]
    out = collate_clips(items)
    assert out["clip"].shape == (3, 4, 3, 8, 8) and out["label"].dtype == torch.int64 and out["bad"] == []
    feats = collate_clips([(torch.zeros(4, 512), 1, ()), (torch.ones(4, 512), 0, ())])
    assert feats["features"].shape == (2, 4, 512) and "clip" not in feats
    empty = collate_clips([BadSample("x.mp4", "E: e")])
    assert empty["clip"].shape[0] == 0 and empty["label"].shape == (0,) and len(empty["bad"]) == 1


def test_open_video_split_picks_the_format(tmp_path, clips_dir):
    _tree(tmp_path / "folders" / "val", clips_dir, {"a": ["tree.avi"], "b": ["cup.mp4"]})
    src = open_video_split(SimpleNamespace(data_dir=tmp_path / "folders", video_format="folders"), "val", 16)
    assert isinstance(src, VideoFolderSource) and src.classes == ["a", "b"]
    clips, labels = _good(t=6)
    (tmp_path / "arr").mkdir()
    _npz(tmp_path / "arr" / "train.npz", clips, labels)
    np.save(tmp_path / "arr" / "val_clips.npy", clips)
    np.save(tmp_path / "arr" / "val_labels.npy", labels)
    cfg = SimpleNamespace(data_dir=str(tmp_path / "arr"), video_format="arrays", num_frames=4, frame_stride=2)
    assert open_video_split(cfg, "train", 16).clips_file.endswith("train.npz")
    assert open_video_split(cfg, "val", 16).clips_file.endswith("val_clips.npy")
    cfg.short_clips = "reject"
    with pytest.raises(DataError, match="clips have 6 frames, fewer than a clip of 4 frames at stride 2 spans"):
        open_video_split(cfg, "val", 16)
    with pytest.raises(ConfigError, match="video_format"):
        open_video_split(SimpleNamespace(data_dir=tmp_path, video_format="hdf5"), "val", 16)
