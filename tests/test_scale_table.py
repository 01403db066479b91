"""``benchmarks/scale.py``'s Markdown table: one size run (``--sizes 1``) gives no exponent to fit, and the
table says so instead of printing ``nan`` in the exponent and 15x columns."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _measure(seconds: float, peak: float = 300.0) -> dict:
    return {"seconds": seconds, "peak_rss_mib": peak, "base_rss_mib": 100.0}


def _coco_size(k: float) -> dict:
    worker = {"0": {"uss_first": 100.0 * k, "uss_last": 105.0 * k, "rss_first": 200.0, "rss_last": 210.0}}
    return {
        "images": int(118_000 * k),
        "json_mb": 450.0 * k,
        **{m: _measure(6.0 * k) for m in ("json", "pycocotools", "scan", "scan_build")},
        "scan_hit": _measure(0.8 * k, 120.0),
        "startup": {"startup_s": 9.0 * k, "peak_rss_mib": 900.0 * k, "workers": worker},
    }


def _table(sizes) -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    res = {"machine": "test", "date": "2026-11-28", "coco": {s: _coco_size(float(s)) for s in sizes}, "imagenet": {}}
    return scale.table(res)


def test_one_size_says_no_exponent_instead_of_nan():
    md = _table(["1"])
    assert "nan" not in md, md
    assert md.count(scale_no_fit()) == 2 * 14, md  # the exponent and 15x cells of each of the 14 COCO rows


def test_two_sizes_fit_the_exponent_and_extrapolate():
    md = _table(["1", "4"])
    assert "nan" not in md and scale_no_fit() not in md, md
    # every synthetic figure grows linearly with the size: b = 1.00 and 15x = 15 x the 1x figure
    assert "| json.load, s | 6.00 | 24.00 | 1.00 | 90 (extrapolated) |" in md, md


def scale_no_fit() -> str:
    import scale

    return scale._NO_FIT
