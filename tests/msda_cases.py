"""Shared inputs and an independent float64 implementation for the multi-scale deformable attention tests."""

from __future__ import annotations

import math

import torch

#: DINO-4scale feature levels (H, W) for an 800 x 1333 image (strides 8, 16, 32, 64).
DINO_LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))


def make_inputs(
    n=2,
    lq=5,
    m=2,
    d=3,
    levels=((4, 5), (2, 3), (1, 1)),
    p=2,
    dtype=torch.float64,
    device="cpu",
    loc_range=(-0.1, 1.1),
    seed=0,
):
    """Random inputs in the op's layout; locations partly outside [0, 1] to exercise zero padding."""
    g = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(levels, dtype=torch.int64)
    hw = shapes.prod(1)
    starts = torch.cat([hw.new_zeros(1), hw.cumsum(0)[:-1]])
    s, n_levels = int(hw.sum()), len(levels)
    value = torch.randn(n, s, m, d, generator=g, dtype=torch.float64)
    lo, hi = loc_range
    loc = torch.rand(n, lq, m, n_levels, p, 2, generator=g, dtype=torch.float64) * (hi - lo) + lo
    loc = away_from_pixel_edges(loc, shapes)
    attn = torch.rand(n, lq, m, n_levels, p, generator=g, dtype=torch.float64)
    attn = attn / attn.sum((-1, -2), keepdim=True)
    cast = dict(dtype=dtype, device=device)
    return value.to(**cast), shapes.to(device), starts.to(device), loc.to(**cast), attn.to(**cast)


def away_from_pixel_edges(loc, shapes, margin=1e-3):
    """Move sample positions that lie within ``margin`` pixels of a pixel-centre line to midway between two.

    Bilinear sampling is not differentiable there: the location gradient jumps, so a position that fp32
    rounds to the other side of the line than float64 does would make gradients differ by O(1).
    """
    size = shapes.flip(1).to(loc.dtype).view(1, 1, 1, -1, 1, 2)  # (W, H) per level
    pix = loc * size - 0.5
    frac = pix - pix.floor()
    near = (frac < margin) | (frac > 1 - margin)
    pix = torch.where(near, pix.floor() + 0.5, pix)
    return (pix + 0.5) / size


def naive_msda(value, shapes, loc, attn):
    """Deformable DETR eq. 3 by explicit loops in float64, independent of grid_sample.

    Pixel (i, j) of a level is centred at normalised ((j + 0.5) / W, (i + 0.5) / H); a sample at normalised
    (x, y) interpolates the four surrounding pixel centres bilinearly, pixels outside the grid counting zero.
    """
    value, loc, attn = value.double().cpu(), loc.double().cpu(), attn.double().cpu()
    n, _, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = loc.shape
    out = torch.zeros(n, lq, m, d, dtype=torch.float64)
    start = 0
    for lvl in range(n_levels):
        h, w = (int(v) for v in shapes[lvl])
        grid = value[:, start : start + h * w].reshape(n, h, w, m, d)
        start += h * w
        for b in range(n):
            for q in range(lq):
                for head in range(m):
                    for pt in range(n_points):
                        px = loc[b, q, head, lvl, pt, 0].item() * w - 0.5
                        py = loc[b, q, head, lvl, pt, 1].item() * h - 0.5
                        x0, y0 = math.floor(px), math.floor(py)
                        sample = torch.zeros(d, dtype=torch.float64)
                        for yy, xx in ((y0, x0), (y0, x0 + 1), (y0 + 1, x0), (y0 + 1, x0 + 1)):
                            if 0 <= yy < h and 0 <= xx < w:
                                weight = (1 - abs(px - xx)) * (1 - abs(py - yy))
                                sample += weight * grid[b, yy, xx, head]
                        out[b, q, head] += attn[b, q, head, lvl, pt].item() * sample
    return out.reshape(n, lq, m * d)


def loaded_libraries(maps_text: str, stem: str) -> list[str]:
    """The files of ``/proc/<pid>/maps`` text whose name starts with ``stem`` (e.g. ``libcudart``): the shared
    libraries of that name the process has loaded, each once, in the order first mapped."""
    paths = (line.split(None, 5)[5].strip() for line in maps_text.splitlines() if len(line.split(None, 5)) == 6)
    return list(dict.fromkeys(p for p in paths if p.startswith("/") and p.rsplit("/", 1)[-1].startswith(stem)))
