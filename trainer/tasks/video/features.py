"""Cached per-frame features of a frozen backbone (seed 004's frozen ResNet-18): compute once, train the Transformer
over time on them.

Every frame of every clip of a split goes through the frozen backbone once, at the training frame size, and is
stored as float16 (``num_frames`` x ``feature_dim``) in ``<cache_dir>/<key>/<i>.npy``; the clip sampler then picks
its frame indices from the cached rows exactly as it picks frames from the video, so random temporal crops still
work. ``key`` is a SHA-256 over what the features depend on: each clip's identity (file path, size and
modification time, and its index inside an array file), the backbone's weights, the frame size, the decoder
transform version and the feature dtype. Any change gives a new key, hence a fresh folder (an old one is left
for the user to delete). A split is complete when ``<key>/complete.json`` exists; files are written atomically
(temporary name, then rename), so an interrupted fill resumes where it stopped.

Size: seed 004's 10,000 clips x 32 frames x 512 features x 2 bytes = 328 MB (its own estimate: ~330 MB).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from trainer.data.transforms import normalize_on_device
from trainer.errors import DataError

#: Bump when the way frames are decoded/resized changes (the cached features would no longer match).
TRANSFORM_VERSION = 1
#: Frames per backbone forward while filling the cache.
FILL_CHUNK = 256


def weights_digest(module: nn.Module) -> str:
    """SHA-256 (hex) over the names, shapes, dtypes and bytes of ``module``'s state_dict (parameters and
    buffers: BatchNorm statistics change features too)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _clip_identity(source, i: int) -> str:
    name = source.name(i)
    path = name.split("[", 1)[0]
    try:
        st = os.stat(path)
        return f"{name}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        return name


def cache_key(source, backbone_digest: str, image_size: int) -> str:
    """16-hex-digit key of one split's cache (see the module doc for what goes in)."""
    h = hashlib.sha256(
        json.dumps(
            {"backbone": backbone_digest, "size": image_size, "transform": TRANSFORM_VERSION, "dtype": "float16"}
        ).encode()
    )
    for i in range(len(source)):
        h.update(_clip_identity(source, i).encode() + b"\n")
    return h.hexdigest()[:16]


class FeatureSource:
    """A clip source (the protocol of :mod:`trainer.data.formats.video`) over cached features.

    ``read(i, indices)`` returns float16 (t, feature_dim): the cached rows of clip ``i``'s frames ``indices``;
    labels, names, frame counts and classes are the decoded source's. Picklable (opens files per read,
    memory-mapped)."""

    def __init__(self, source, folder: Path, feature_dim: int):
        self.source, self.folder, self.feature_dim = source, Path(folder), feature_dim
        self.classes = source.classes

    def __len__(self) -> int:
        return len(self.source)

    def label(self, i: int) -> int:
        return self.source.label(i)

    def num_frames(self, i: int) -> int:
        return self.source.num_frames(i)

    def name(self, i: int) -> str:
        return self.source.name(i)

    def read(self, i: int, indices: list[int]) -> torch.Tensor:
        rows = np.load(self.folder / f"{i}.npy", mmap_mode="r")
        return torch.from_numpy(np.ascontiguousarray(rows[list(indices)]))

    @property
    def resident_bytes(self) -> int:
        return 0

    @property
    def file_bytes(self) -> int:
        """Bytes of the cached feature files (memory-mapped: shared through the page cache)."""
        return sum(f.stat().st_size for f in self.folder.glob("*.npy"))


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


@torch.no_grad()
def fill_cache(
    source,
    backbone: nn.Module,
    folder: Path,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    log=print,
) -> int:
    """Compute the features of every frame of the clips ``i % world_size == rank`` of ``source`` that are not
    cached yet; returns how many clips this rank computed.

    ``backbone``: frozen, in eval mode, maps ImageNet-normalised float (N, 3, S, S) to (N, D). Frames are read
    with ``source.read`` (uint8 (t, 3, S, S), the whole clip in one pass) and go through the backbone in
    chunks of :data:`FILL_CHUNK`.

    Raises:
        DataError: a clip cannot be decoded (names it); the cache cannot be written (names the folder).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"feature_cache_dir: cannot create {folder} ({e.strerror or e})") from None
    backbone = backbone.eval().to(device)
    done = 0
    for i in range(rank, len(source), world_size):
        out = folder / f"{i}.npy"
        if out.exists():
            continue
        try:  # one decoding pass over the whole clip (re-reading chunks would decode B-frame streams again)
            frames = source.read(i, list(range(source.num_frames(i))))
        except Exception as e:  # noqa: BLE001 - any decoder failure names the clip
            raise DataError(f"feature cache: cannot decode {source.name(i)} ({type(e).__name__}: {e})") from None
        parts = [
            backbone(normalize_on_device(frames[s : s + FILL_CHUNK], device, False)).float().cpu()
            for s in range(0, len(frames), FILL_CHUNK)
        ]
        try:
            _atomic_save(out, torch.cat(parts).to(torch.float16).numpy())
        except OSError as e:
            raise DataError(f"feature_cache_dir: cannot write {out} ({e.strerror or e})") from None
        done += 1
    if done:
        log(f"feature cache: rank {rank} computed {done} clip(s) into {folder}")
    return done


def open_cached(
    source,
    backbone: nn.Module,
    cache_dir: Path,
    image_size: int,
    feature_dim: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    barrier=None,
    log=print,
) -> tuple[FeatureSource, str]:
    """The split's :class:`FeatureSource`, filling the cache first when incomplete (each rank its share, then
    ``barrier()``). Returns ``(source, report line)``."""
    key = cache_key(source, weights_digest(backbone), image_size)
    folder = Path(cache_dir) / key
    marker = folder / "complete.json"
    hit = marker.exists()
    if not hit:
        fill_cache(source, backbone, folder, device, rank, world_size, log)
        if barrier is not None:
            barrier()
        if rank == 0:
            missing = [i for i in range(len(source)) if not (folder / f"{i}.npy").exists()]
            if missing:
                raise DataError(f"feature cache: {len(missing)} clip(s) missing in {folder} after the fill")
            marker.write_text(json.dumps({"clips": len(source), "feature_dim": feature_dim, "size": image_size}))
        if barrier is not None:
            barrier()
    feats = FeatureSource(source, folder, feature_dim)
    line = (
        f"data: feature cache {'hit' if hit else 'filled'}: {folder} ({len(source)} clips, "
        f"{feats.file_bytes / 2**20:.1f} MiB float16)"
    )
    return feats, line


def default_cache_dir(checkpoint_dir: str, configured: Optional[str]) -> Path:
    """``feature_cache_dir`` when set, else ``<checkpoint_dir>/../feature-cache``."""
    return Path(configured) if configured else Path(checkpoint_dir).resolve().parent / "feature-cache"
