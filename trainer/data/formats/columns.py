"""Per-sample metadata as flat numpy arrays (no Python object per sample), read like lists.

A dataset that keeps a Python ``list`` of per-sample strings, ints or tuples makes loader workers grow over an
epoch: each access touches the objects' reference counts, so pages shared with the parent are copied (under
``fork``), and every worker unpickles millions of small objects (under ``forkserver``/``spawn``). The usual
cure is to keep the metadata in a few numpy buffers (detectron2's ``DatasetFromList(serialize=True)``,
``detectron2/data/common.py``; PyTorch GitHub issue #13246 "DataLoader: memory usage grows with Python lists").

:class:`IntColumn` (int64 values, or rows of them as tuples), :class:`StringColumn` (UTF-8 strings in one
byte buffer plus offsets, optionally joined to a root folder on access) and :class:`LabelledPaths` (ImageFolder's
``(path, class)`` pairs) are read-only
:class:`collections.abc.Sequence` s: ``len``, indexing (a plain ``int``/``tuple``/``str``, so callers and
error messages see what a list gave them), iteration, ``index``, ``in`` and ``==`` against a list all work.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np


class IntColumn(Sequence):
    """Integers (int64 ``(N,)``: items are ``int``) or integer rows (int64 ``(N, K)``: items are ``tuple`` of
    ``int``), e.g. image ids or ``(height, width)`` pairs in pixels. ``values`` is the array itself."""

    __slots__ = ("values",)

    def __init__(self, values: Iterable | np.ndarray):
        arr = values if isinstance(values, np.ndarray) else np.asarray(list(values), dtype=np.int64)
        self.values = arr.astype(np.int64, copy=False)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return IntColumn(self.values[i])
        v = self.values[i]
        return int(v) if v.ndim == 0 else tuple(int(x) for x in v)

    def __iter__(self):
        return iter(self.values.tolist() if self.values.ndim == 1 else map(tuple, self.values.tolist()))

    def __eq__(self, other) -> bool:
        if isinstance(other, IntColumn):
            return np.array_equal(self.values, other.values)
        return isinstance(other, (list, tuple)) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"IntColumn({self.values.tolist()!r:.200})"

    def take(self, keep: Sequence[int] | np.ndarray) -> IntColumn:
        """The items at positions ``keep`` (in that order)."""
        return IntColumn(self.values[np.asarray(keep, dtype=np.int64)])


class StringColumn(Sequence):
    """Strings stored as one UTF-8 byte buffer (uint8 ``data``) and int64 ``offsets`` ((N + 1,), item ``i`` is
    ``data[offsets[i]:offsets[i + 1]]``); with ``root``, item ``i`` is ``os.path.join(root, name)`` normalised
    like ``str(pathlib.Path(root) / name)``. Lone surrogates (file names that are not valid UTF-8, as
    ``os.fsdecode`` gives them) survive the round trip."""

    __slots__ = ("data", "offsets", "root")

    def __init__(self, data: np.ndarray, offsets: np.ndarray, root: str | None = None):
        self.data, self.offsets, self.root = data, offsets.astype(np.int64, copy=False), root

    @classmethod
    def from_strings(cls, strings: Iterable[str], root: str | os.PathLike | None = None) -> StringColumn:
        """Pack ``strings`` (with ``root`` joined on access, when given)."""
        enc = [s.encode("utf-8", "surrogateescape") for s in strings]
        offsets = np.zeros(len(enc) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, enc), dtype=np.int64, count=len(enc)), out=offsets[1:])
        data = np.frombuffer(b"".join(enc), dtype=np.uint8).copy()
        return cls(data, offsets, None if root is None else os.fspath(root))

    def name(self, i: int) -> str:
        """Item ``i`` without the root."""
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"StringColumn index {i} out of range for {n} items")
        name = self.name(i % n)
        return name if self.root is None else _join(self.root, name)

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, StringColumn)) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"StringColumn({len(self)} items, root={self.root!r})"

    def take(self, keep: Sequence[int] | np.ndarray) -> StringColumn:
        """The items at positions ``keep`` (in that order)."""
        keep = np.asarray(keep, dtype=np.int64)
        starts, ends = self.offsets[keep], self.offsets[keep + 1]
        lens = ends - starts
        offsets = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        # byte positions of every kept item, one vectorised gather
        idx = np.repeat(starts - offsets[:-1], lens) + np.arange(int(offsets[-1]), dtype=np.int64)
        return StringColumn(self.data[idx], offsets, self.root)


def _join(root: str, name: str) -> str:
    """``str(Path(root) / name)``: the string a list of ``Path`` joins held (normalised the same way)."""
    return str(Path(root) / name)


class LabelledPaths(Sequence):
    """``(path, class index)`` pairs, as ImageFolder's ``samples`` list gives them, in a :class:`StringColumn` and
    an int64 array: ``self[i]`` is ``(str, int)``; iteration, ``len`` and ``==`` against a list as for a list."""

    __slots__ = ("paths", "labels")

    def __init__(self, pairs: Iterable[tuple[str, int]] = (), paths: StringColumn | None = None, labels=None):
        if paths is None:
            pairs = list(pairs)
            paths = StringColumn.from_strings(p for p, _ in pairs)
            labels = np.fromiter((c for _, c in pairs), dtype=np.int64, count=len(pairs))
        self.paths, self.labels = paths, np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        if isinstance(i, slice):
            keep = range(len(self))[i]
            return LabelledPaths(paths=self.paths.take(keep), labels=self.labels[keep.start : keep.stop : keep.step])
        return self.paths[i], int(self.labels[i])

    def __iter__(self):
        return zip(iter(self.paths), self.labels.tolist())

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, LabelledPaths)) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"LabelledPaths({len(self)} items)"
