"""The CUDA caching allocator model (trainer/planning/allocator.py) on hand-built sequences whose reserved bytes
follow from the rules of c10/cuda/CUDACachingAllocator.cpp (kSmallSize 1 MiB, kSmallBuffer 2 MiB, kMinLargeAlloc
10 MiB, kLargeBuffer 20 MiB, kRoundLarge 2 MiB; best fit by (size, address); should_split; merging on free)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainer.planning.allocator import MIB, AllocatorModel, CachingAllocatorModel, round_size, segment_size

KIB = 1024


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(MIB) == 2 * MIB  # <= kSmallSize: small pool
    assert segment_size(MIB + 512) == segment_size(10 * MIB - 512) == 20 * MIB  # < kMinLargeAlloc: kLargeBuffer
    assert segment_size(10 * MIB) == 10 * MIB and segment_size(25 * MIB) == 26 * MIB  # kRoundLarge


def test_three_6_mib_blocks_share_a_20_mib_segment_and_7_mib_in_the_hole_needs_a_new_one():
    m = CachingAllocatorModel()
    a, b, c = (m.malloc(6 * MIB) for _ in range(3))
    assert (m.segments, m.reserved, m.allocated) == (1, 20 * MIB, 18 * MIB)
    assert [blk.addr for blk in (a, b, c)] == [0, 6 * MIB, 12 * MIB]  # each split from the segment's low end
    m.free(b)  # a 6 MiB hole between a and c, and the 2 MiB tail: nothing merges
    assert m.cached_free_bytes == 8 * MIB
    d = m.malloc(7 * MIB)  # fits in neither free block: a second 20 MiB segment
    assert (m.segments, m.reserved, m.allocated) == (2, 40 * MIB, 19 * MIB) and d.addr == 20 * MIB
    e = m.malloc(6 * MIB)  # best fit: the 6 MiB hole (not the 13 MiB rest of the second segment)
    assert e.addr == 6 * MIB and m.segments == 2


def test_small_requests_share_2_mib_segments_in_their_own_pool():
    m = CachingAllocatorModel()
    blocks = [m.malloc(512 * KIB) for _ in range(4)]  # fill one 2 MiB segment exactly
    assert (m.segments, m.reserved, m.cached_free_bytes) == (1, 2 * MIB, 0)
    tiny = m.malloc(1)  # rounded to 512 B, a second small segment
    assert (tiny.size, m.segments, m.reserved) == (512, 2, 4 * MIB)
    one = m.malloc(MIB)  # exactly kSmallSize: still small, fits the second segment's rest
    assert (one.small, m.segments) == (True, 2)
    big = m.malloc(MIB + 1)  # large pool: a 20 MiB segment, the small pool's free bytes are not used
    assert (big.small, m.segments, m.reserved) == (False, 3, 24 * MIB)
    for blk in blocks:
        m.free(blk)
    again = m.malloc(MIB)  # the four merged into one free 2 MiB block; the best fit (the other rest is < 1 MiB)
    assert (again.addr, m.segments) == (0, 3)


def test_freed_neighbours_merge_and_serve_a_larger_request():
    m = CachingAllocatorModel()
    a, b, c, d = (m.malloc(4 * MIB) for _ in range(4))  # one 20 MiB segment: 16 MiB used, 4 MiB tail free
    m.free(b)
    m.free(c)  # merges with b: one free 8 MiB block between a and d
    assert m.cached_free_bytes == 12 * MIB
    e = m.malloc(8 * MIB)
    assert (e.addr, e.size, m.segments) == (4 * MIB, 8 * MIB, 1)
    m.free(d)  # merges with the 4 MiB tail
    f = m.malloc(8 * MIB)
    assert (f.addr, m.segments) == (12 * MIB, 1)
    for blk in (a, e, f):
        m.free(blk)
    assert m.cached_free_bytes == 20 * MIB and m.malloc(20 * MIB).addr == 0  # the whole segment again, unsplit


def test_large_requests_round_to_2_mib_and_remainders_of_1_mib_or_less_stay_with_the_block():
    m = CachingAllocatorModel()
    x = m.malloc(25 * MIB)  # 26 MiB segment; the 1 MiB remainder is not > kSmallSize: not split
    assert (m.reserved, x.size, m.allocated) == (26 * MIB, 26 * MIB, 26 * MIB)  # memory_allocated counts it
    y = m.malloc(10 * MIB + 512 * KIB)  # 12 MiB segment, 1.5 MiB remainder split off and cached
    assert (m.reserved, y.size, m.cached_free_bytes) == (38 * MIB, 10 * MIB + 512 * KIB, 1536 * KIB)
    m.malloc(1536 * KIB)  # a large-pool request that the cached remainder serves
    assert (m.segments, m.cached_free_bytes) == (2, 0)


def test_segments_are_never_released_and_peak_reserved_never_drops():
    m = CachingAllocatorModel()
    blocks = [m.malloc(n * MIB) for n in (30, 3, 50)]
    peak = m.reserved
    assert peak == 30 * MIB + 20 * MIB + 50 * MIB
    for blk in blocks:
        m.free(blk)
    assert (m.allocated, m.reserved, m.peak_reserved, m.peak_allocated) == (0, peak, peak, 83 * MIB)
    again = [m.malloc(n * MIB) for n in (50, 3, 30)]  # all served from the cache
    assert (m.segments, m.peak_reserved) == (3, peak) and [b.size for b in again] == [50 * MIB, 3 * MIB, 30 * MIB]


def test_dispatch_mode_mallocs_new_storages_and_frees_dead_ones():
    alloc = AllocatorModel()
    six = 6 * MIB // 4  # float32 elements in 6 MiB
    with FakeTensorMode(), alloc:
        a, b, c = (torch.empty(six) for _ in range(3))
        view = b[:10]  # a view: no new storage
        assert (alloc.reserved, alloc.allocated) == (20 * MIB, 18 * MIB)
        del b, view
        assert alloc.allocated == 12 * MIB
        d = torch.empty(7 * MIB // 4)  # the 6 MiB hole does not fit it: a new segment
        assert alloc.reserved == 40 * MIB
        e = a + c  # an op's output: 6 MiB, into the hole
        assert (alloc.reserved, alloc.allocated) == (40 * MIB, 25 * MIB)
        del a, c, d, e
    assert (alloc.allocated, alloc.reserved, alloc.peak_allocated) == (0, 40 * MIB, 25 * MIB)
