"""Decoded clips stored as numpy arrays: uint8 ``clips`` (N, T, H, W, 3) with int ``labels`` (N,).

Two layouts:

* ``<file>.npz`` with keys ``clips``, ``labels`` and optionally ``classes`` (names, N-independent). A member
  written by ``np.savez`` is *stored* (not compressed), so its bytes lie contiguous in the file and ``clips`` is
  memory-mapped at its offset (:func:`_stored_member_memmap`): processes share the page cache. A compressed
  member (``np.savez_compressed``) cannot be mapped: it is decompressed into the RAM of **each process** that
  reads it (every DataLoader worker and every rank), on its first :meth:`ArraySource.read`.
* ``<root>/<split>_clips.npy`` + ``<root>/<split>_labels.npy`` (+ optional ``<root>/classes.txt``, one name a
  line). The clips are opened with ``np.load(mmap_mode="r")``: memory-mapped, so processes share the OS page
  cache and hold no private copy.

Everything is checked at construction from the array headers (no pixel is read): a bad file raises
:class:`~trainer.errors.DataError` naming the file, the key and what was expected.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from trainer.data.formats.video.decode import fit_frames
from trainer.errors import DataError, error_detail


def _npz_header(path: str, key: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of member ``key`` of an .npz from its .npy header, without reading the data."""
    try:
        with zipfile.ZipFile(path) as z, z.open(f"{key}.npy") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
    except KeyError:
        with zipfile.ZipFile(path) as z:
            keys = [n.removesuffix(".npy") for n in z.namelist()]
        raise DataError(f"{path}: no key '{key}' (keys: {', '.join(keys) or 'none'})") from None
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable .npz ({error_detail(e)})") from None
    return tuple(shape), np.dtype(dtype)


def _stored_member_memmap(path: str, key: str) -> np.memmap | None:
    """Member ``key`` of an .npz memory-mapped in place when it is stored uncompressed (``np.savez``), else None.

    The member's data start = its local file header offset + 30 + name and extra field lengths (the ZIP format,
    APPNOTE 4.3.7) + the .npy header's length (read through ``zipfile``)."""
    import struct

    with zipfile.ZipFile(path) as z:
        info = z.getinfo(f"{key}.npy")
        if info.compress_type != zipfile.ZIP_STORED:
            return None
        with z.open(info) as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            npy_header = f.tell()
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        local = fh.read(30)
    if local[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    offset = info.header_offset + 30 + name_len + extra_len + npy_header
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape), order="F" if fortran else "C")


def _load(path: str, key: str | None = None, mmap: bool = False) -> np.ndarray:
    try:
        if key is None:
            return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        if mmap:
            mapped = _stored_member_memmap(path, key)
            if mapped is not None:
                return mapped
        with np.load(path, allow_pickle=False) as z:
            if key not in z.files:
                raise DataError(f"{path}: no key '{key}' (keys: {', '.join(z.files) or 'none'})")
            return z[key]
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        where = f"{path}[{key!r}]" if key else path
        raise DataError(f"{where}: cannot be read as a numpy array ({error_detail(e)})") from None


def check_clips(where: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Raise :class:`DataError` unless ``shape``/``dtype`` are a non-empty uint8 (N, T, H, W, 3) clip array."""
    if len(shape) != 5:
        raise DataError(f"{where}: clips have rank {len(shape)} {shape}, expected 5 (N, T, H, W, 3)")
    if dtype != np.uint8:
        raise DataError(f"{where}: clips have dtype {dtype}, expected uint8")
    if shape[-1] != 3:
        raise DataError(f"{where}: clips have {shape[-1]} channels (shape {shape}), expected C=3 (N, T, H, W, 3)")
    if min(shape) == 0:
        raise DataError(f"{where}: clips are empty (shape {shape}), expected N, T, H, W >= 1")


def check_labels(where: str, labels: np.ndarray, n: int, num_classes: int | None) -> None:
    """Raise :class:`DataError` unless ``labels`` is an integer (n,) array with values in 0 .. num_classes-1."""
    if labels.ndim != 1 or labels.shape[0] != n:
        raise DataError(f"{where}: labels have shape {labels.shape}, expected ({n},) (one per clip)")
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{where}: labels have dtype {labels.dtype}, expected an integer dtype")
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0:
        raise DataError(f"{where}: label {lo} is negative (clip {int(np.argmin(labels))}), expected 0 or more")
    if num_classes is not None and hi >= num_classes:
        raise DataError(
            f"{where}: label {hi} (clip {int(np.argmax(labels))}) is out of range for {num_classes} classes"
        )


class ArraySource:
    """Clip source over clips stored as numpy arrays (see the module docstring for the two layouts).

    Args:
        path: an ``.npz`` file, or the folder holding ``<split>_clips.npy`` and ``<split>_labels.npy``.
        split: the split name (used for the .npy file names and messages).
        size: side ``S`` of the square frames :meth:`read` returns (shorter side resized, antialiased, then
            centre-cropped: the folder source's rule).

    Attributes: ``classes`` (from ``classes`` / ``classes.txt``, else ``"0" .. str(max label)``), ``labels``
    (int64 numpy (N,)), ``clip_shape`` (T, H, W, 3), ``file_bytes`` (bytes on disk of the clip and label files),
    ``resident_bytes`` (clip bytes this source holds in each process's RAM once read: the full array for a
    compressed .npz, 0 for a stored .npz member or the .npy pair, both memory-mapped), ``report`` (always empty; the folder source's log lines).

    Raises:
        DataError: a file or key is missing or unreadable; clips not rank 5, not uint8, C != 3 or empty; labels
            not (N,), not integer, negative or >= the number of classes (names file, key, got vs expected).
    """

    def __init__(self, path: str | Path, split: str, size: int):
        self.split, self.size, self.report = split, size, []
        p = Path(path)
        self._arr: np.ndarray | None = None
        if p.suffix.lower() == ".npz":
            if not p.is_file():
                raise DataError(f"data split '{split}': {p} does not exist (expected an .npz with clips, labels)")
            self.clips_file = self.labels_file = str(p)
            self._mmap = False  # the .npy pair's flag; a stored .npz member is mapped by _load(mmap=True) too
            shape, dtype = _npz_header(str(p), "clips")
            where = f"{p}['clips']"
            check_clips(where, shape, dtype)
            labels = _load(str(p), "labels")
            with zipfile.ZipFile(p) as z:
                classes = _load(str(p), "classes").tolist() if "classes.npy" in z.namelist() else None
            self.file_bytes = os.path.getsize(p)
            with zipfile.ZipFile(p) as z:
                stored = z.getinfo("clips.npy").compress_type == zipfile.ZIP_STORED
            self.resident_bytes = 0 if stored else int(np.prod(shape))
            lwhere = f"{p}['labels']"
        else:
            self.clips_file, self.labels_file = str(p / f"{split}_clips.npy"), str(p / f"{split}_labels.npy")
            for f in (self.clips_file, self.labels_file):
                if not os.path.isfile(f):
                    raise DataError(
                        f"data split '{split}': {f} does not exist (expected {split}_clips.npy uint8 "
                        f"(N, T, H, W, 3) and {split}_labels.npy int (N,) in {p}, or {p}/{split}.npz)"
                    )
            self._mmap = True
            arr = _load(self.clips_file, mmap=True)
            shape, dtype, where = arr.shape, arr.dtype, self.clips_file
            check_clips(where, shape, dtype)
            labels = _load(self.labels_file)
            names = p / "classes.txt"
            classes = [x.strip() for x in names.read_text().splitlines() if x.strip()] if names.is_file() else None
            self.file_bytes = os.path.getsize(self.clips_file) + os.path.getsize(self.labels_file)
            self.resident_bytes = 0
            lwhere = self.labels_file
        check_labels(lwhere, labels, shape[0], None if classes is None else len(classes))
        self.labels = labels.astype(np.int64)
        self.classes = [str(c) for c in classes] if classes is not None else [str(c) for c in range(labels.max() + 1)]
        self.clip_shape = tuple(int(x) for x in shape[1:])

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_arr"] = None  # reopened (mapped or decompressed) in each process, never pickled
        return state

    @property
    def clips(self) -> np.ndarray:
        """The uint8 (N, T, H, W, 3) clip array (memory-mapped for .npy and stored .npz members; decompressed on
        first use for a compressed .npz)."""
        if self._arr is None:
            self._arr = _load(self.clips_file, mmap=True) if self._mmap else _load(self.clips_file, "clips", mmap=True)
        return self._arr

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def label(self, i: int) -> int:
        """Class index of clip ``i``."""
        return int(self.labels[i])

    def num_frames(self, i: int) -> int:
        """Frames of clip ``i`` (every stored clip has ``T``)."""
        return self.clip_shape[0]

    def name(self, i: int) -> str:
        """``file[i]``: the array file and the clip's row (for messages and BadSample)."""
        return f"{self.clips_file}[{i}]"

    def read(self, i: int, frame_indices: list[int]) -> torch.Tensor:
        """uint8 ``(t, 3, S, S)``: frames ``frame_indices`` of clip ``i`` resized and centre-cropped to ``S``.

        Raises:
            DataError: a frame index outside ``0 .. T-1`` (names the clip)."""
        idx = [int(k) for k in frame_indices]
        if not idx or min(idx) < 0 or max(idx) >= self.clip_shape[0]:
            raise DataError(f"{self.name(i)}: frame indices {idx} outside 0..{self.clip_shape[0] - 1}")
        frames = torch.from_numpy(np.ascontiguousarray(self.clips[i, idx])).permute(0, 3, 1, 2)
        return fit_frames(frames, self.size).contiguous()
