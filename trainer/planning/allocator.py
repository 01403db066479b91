"""An event-driven model of PyTorch's CUDA caching allocator, and the dispatch mode that feeds it fake storages.

:class:`CachingAllocatorModel` replays malloc/free events through the rules of ``DeviceCachingAllocator``
(c10/cuda/CUDACachingAllocator.cpp, namespace ``Native``; default configuration: one stream, no
``max_split_size_mb``, no ``garbage_collection_threshold``, no ``roundup_power2_divisions``, no
``expandable_segments``, no ``empty_cache``). :class:`AllocatorModel` is the ``TorchDispatchMode`` that turns
every new tensor storage into a malloc and the storage's death into a free. No GPU and no CUDA build are needed.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

MIB = 1024**2

#: The allocator's constants, in bytes (c10/cuda/CUDACachingAllocator.cpp): ``kMinBlockSize`` (every request is
#: rounded up to 512 B), ``kSmallSize`` (requests <= 1 MiB use the small pool), ``kSmallBuffer`` (the small
#: pool's 2 MiB segments), ``kMinLargeAlloc`` (large requests < 10 MiB get a ``kLargeBuffer`` segment of 20 MiB),
#: ``kRoundLarge`` (larger requests get a segment of their size rounded up to 2 MiB).
K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = MIB
K_SMALL_BUFFER = 2 * MIB
K_MIN_LARGE_ALLOC = 10 * MIB
K_LARGE_BUFFER = 20 * MIB
K_ROUND_LARGE = 2 * MIB


def round_size(nbytes: int) -> int:
    """Block size (bytes) for a request of ``nbytes``: ``DeviceCachingAllocator::round_size`` without
    ``roundup_power2_divisions`` (the default): at least 512 B, rounded up to a multiple of 512 B."""
    return max(K_MIN_BLOCK_SIZE, -(-int(nbytes) // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)


def segment_size(size: int) -> int:
    """Bytes of the new segment (one ``cudaMalloc``) for a rounded request of ``size`` bytes that no cached block
    serves: ``get_allocation_size``: 2 MiB (``kSmallBuffer``) for <= 1 MiB, 20 MiB (``kLargeBuffer``) below
    10 MiB (``kMinLargeAlloc``), else ``size`` rounded up to 2 MiB (``kRoundLarge``)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class Block:
    """One block of a segment (bytes, a model address): allocated or cached free; ``prev``/``next`` are its
    neighbours in the same segment (``Block`` in CUDACachingAllocator.cpp)."""

    __slots__ = ("size", "addr", "small", "allocated", "prev", "next")

    def __init__(self, size: int, addr: int, small: bool):
        self.size, self.addr, self.small, self.allocated = size, addr, small, False
        self.prev: Optional[Block] = None
        self.next: Optional[Block] = None


class CachingAllocatorModel:
    """Replays ``malloc(nbytes)`` / ``free(block)`` through the CUDA caching allocator's rules (bytes throughout).

    Source: ``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp: ``malloc`` rounds the request
    (:func:`round_size`), picks the pool by the rounded size (small: <= ``kSmallSize``, 1 MiB), takes the
    best-fitting cached free block of that pool (``get_free_block``: the pool's set ordered by
    ``BlockComparatorSize``, (size, address); ``lower_bound``), else a new segment (``alloc_block``,
    :func:`segment_size`); ``should_split`` splits the block when the remainder is >= 512 B in the small pool or
    > 1 MiB in the large pool, the request taking the block's low addresses and the remainder going back to the
    pool (``alloc_found_block``); ``free_block`` merges a freed block with its free neighbours in the same segment
    (``try_merge_blocks``) and caches it. Segments are never released: ``release_cached_blocks`` runs only when a
    ``cudaMalloc`` fails (near an out-of-memory) or on ``empty_cache``, neither of which a plan assumes.

    ``allocated`` = sum of the sizes of allocated blocks, unsplit remainders included (what
    ``torch.cuda.memory_allocated`` reports: ``stats.allocated_bytes`` counts ``block->size``); ``reserved`` =
    bytes of all segments (``torch.cuda.memory_reserved``); ``peak_*`` their maxima; ``segments`` their count.
    Addresses are a model: segments are laid out one after another (they only break ties between free blocks
    of equal size). Cost per event: a binary search and a list insertion in the pool's free list.
    """

    def __init__(self):
        self._free: tuple[list, list] = ([], [])  # large, small pool: sorted (size, addr, Block) of free blocks
        self._end = 0
        self.allocated = self.reserved = self.segments = 0
        self.peak_allocated = self.peak_reserved = 0

    def malloc(self, nbytes: int) -> Block:
        """Allocate a block for a request of ``nbytes`` bytes (> 0); returns the block to pass to :meth:`free`."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        pool = self._free[small]
        i = bisect_left(pool, (size,))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            seg = segment_size(size)
            block = Block(seg, self._end, small)
            self._end += seg
            self.reserved += seg
            self.segments += 1
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= K_MIN_BLOCK_SIZE if small else rest > K_SMALL_SIZE:
            tail = Block(rest, block.addr + size, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            insort(pool, (rest, tail.addr, tail))
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block) -> None:
        """Return ``block`` to its pool, merged with its free neighbours in the same segment."""
        block.allocated = False
        self.allocated -= block.size
        pool = self._free[block.small]
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            del pool[bisect_left(pool, (prev.size, prev.addr))]
            block.addr, block.size, block.prev = prev.addr, prev.size + block.size, prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.allocated:
            del pool[bisect_left(pool, (nxt.size, nxt.addr))]
            block.size, block.next = block.size + nxt.size, nxt.next
            if block.next is not None:
                block.next.prev = block
        insort(pool, (block.size, block.addr, block))

    @property
    def cached_free_bytes(self) -> int:
        """Bytes of cached free blocks (reserved - allocated): the fragmentation and cache the model predicts."""
        return sum(e[0] for pool in self._free for e in pool)


class AllocatorModel(TorchDispatchMode):
    """Dispatch mode that feeds every new tensor storage to a :class:`CachingAllocatorModel` (bytes).

    A storage that appears on an op's output (or is passed to :meth:`track`) is one ``malloc`` of its
    ``nbytes``; its death (a weak-reference finalizer, as torch's ``MemTracker`` does) is the matching ``free``.
    Empty storages are skipped (the CUDA allocator returns no block for 0 bytes). ``allocated`` / ``reserved``
    and their peaks compare with ``torch.cuda.(max_)memory_allocated`` / ``(max_)memory_reserved``.
    """

    def __init__(self):
        super().__init__()
        self._live = WeakIdKeyDictionary()
        self.sim = CachingAllocatorModel()

    allocated = property(lambda self: self.sim.allocated, doc="Bytes in allocated blocks now.")
    reserved = property(lambda self: self.sim.reserved, doc="Bytes of segments now (never falls).")
    peak_allocated = property(lambda self: self.sim.peak_allocated, doc="Peak of ``allocated`` (bytes).")
    peak_reserved = property(lambda self: self.sim.peak_reserved, doc="Peak of ``reserved`` (bytes).")

    def track(self, tensors) -> None:
        """Allocate the storages of ``tensors`` not yet seen (an iterable; e.g. parameters made before entering)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st not in self._live and st.nbytes() > 0:
                    block = self.sim.malloc(st.nbytes())
                    self._live[st] = block
                    torch.utils.weak.weakref.finalize(st, self.sim.free, block)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_flatten(out)[0])
        return out
