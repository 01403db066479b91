"""Cost as the data grows: start-up, host memory per rank, loader-worker memory over an epoch, COCO evaluation.

Synthetic metadata only (no pixels): a COCO-format JSON with COCO train2017's shape (118,287 images, 7.3 boxes
per image on average with a long tail to 100, 80 sparse category ids 1..90 with a skewed frequency, 1% crowd
boxes, 1% images without boxes) and a folder of empty image files; an ImageFolder tree of empty files (ImageNet:
1,281,167 files in 1,000 classes). Sizes are multiples of COCO train2017 (``--sizes 0.25,1,4``) and of ImageNet
train (``--imagenet 0.1,1``). Every measurement runs in a fresh interpreter that has imported the same modules
(numpy, torch, pycocotools, faster-coco-eval, the trainer's readers), so peak RSS
compares like with like; times exclude imports; peaks are ``VmHWM``.

Per COCO size:

* ``json.load`` and pycocotools' ``COCO(file)`` (the references), ``scan_coco`` without a cache, ``scan_coco``
  filling the cache (local rank 0 of a node) and mapping it (the other local ranks, and later runs);
* start-up to the first batch (scan from the cache + the num_queries check + dataset + loader with 2 workers
  + its first batch), and peak RSS of that rank;
* each loader worker's RSS and USS (private bytes) after its first batch and after an epoch of index accesses
  (every image's path, size, id and boxes touched; no decoding), with the per-image metadata as flat columns
  and, ``legacy``, as the Python lists the readers held before (copy-on-access growth).

Per ImageNet size: ``scan_split`` (the folder walk), and the same worker RSS over an epoch, columns vs lists.
Once: COCO evaluation of 5,000 images x 100 detections (val2017's size) by pycocotools, faster-coco-eval and
the trainer's ``CocoEvaluator``.

Writes ``OUT/results.json``, ``OUT/table.md`` (the docs table, with the exponent ``b`` of ``cost ~ size^b``
fitted by least squares on log-log over the sizes run, and an extrapolation to 15x COCO, Objects365's size)
and ``OUT/scale.png`` (log-log plot). Usage::

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale.py --sizes 0.25,1,4 --imagenet 0.1,1 \\
        --out /tmp/scale-out [--work /tmp/scale-data] [--skip-eval] [--legacy-too]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

COCO_IMAGES = 118_287
IMAGENET_FILES = 1_281_167
IMAGENET_CLASSES = 1_000
#: COCO's 80 category ids (1..90 with gaps), https://cocodataset.org/#format-data (instances_train2017.json).
COCO_CAT_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
EVAL_IMAGES, EVAL_DETS = 5_000, 100


# --- synthetic data ---------------------------------------------------------------------------------------
def make_coco(folder: Path, n_images: int, seed: int = 0, files: bool = True) -> Path:
    """``folder/ann.json`` (+ ``folder/images/`` of empty files): COCO train2017's shape at ``n_images``."""
    ann_path = folder / "ann.json"
    if ann_path.exists():
        return ann_path
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    counts = np.minimum(1 + rng.negative_binomial(1.1, 1.1 / (1.1 + 6.3), n_images), 100)
    counts[rng.random(n_images) < 0.01] = 0
    sizes = np.array([(640, 480), (640, 427), (480, 640), (640, 426), (500, 375), (640, 640)])
    wh = sizes[rng.integers(0, len(sizes), n_images)]
    ids = rng.permutation(np.arange(1, 6 * n_images))[:n_images]  # sparse, shuffled ids like COCO's
    freq = 1.0 / np.arange(1, 81) ** 0.9
    images = [
        {"id": int(i), "file_name": f"{int(i):012d}.jpg", "width": int(w), "height": int(h)}
        for i, (w, h) in zip(ids, wh)
    ]
    img_of = np.repeat(np.arange(n_images), counts)
    n = len(img_of)
    W, H = wh[img_of, 0], wh[img_of, 1]
    side = np.exp(rng.normal(3.7, 1.0, (n, 2)))  # box sides in px: small, medium and large all present
    bw, bh = np.minimum(side[:, 0], W - 1), np.minimum(side[:, 1], H - 1)
    x, y = rng.random(n) * (W - bw), rng.random(n) * (H - bh)
    cats = np.asarray(COCO_CAT_IDS)[rng.choice(80, n, p=freq / freq.sum())]
    crowd = rng.random(n) < 0.01
    bbox = np.round(np.stack([x, y, bw, bh], 1), 2).tolist()
    anns = [
        {
            "id": k + 1,
            "image_id": int(ids[img_of[k]]),
            "category_id": int(cats[k]),
            "bbox": bbox[k],
            "area": round(bbox[k][2] * bbox[k][3], 2),
            "iscrowd": int(crowd[k]),
        }
        for k in range(n)
    ]
    categories = [{"id": c, "name": f"category_{c}", "supercategory": "thing"} for c in COCO_CAT_IDS]
    doc = {"images": images, "annotations": anns, "categories": categories}
    ann_path.write_text(json.dumps(doc, separators=(",", ":")))  # compact, as exporters write it
    if files:
        d = folder / "images"
        d.mkdir(exist_ok=True)
        for im in images:
            open(d / im["file_name"], "wb").close()
    return ann_path


def make_imagefolder(folder: Path, n_files: int, n_classes: int = IMAGENET_CLASSES) -> Path:
    """``folder/train/nXXXXXXXX/nXXXXXXXX_K.JPEG`` empty files, ImageNet's layout; returns ``folder``."""
    done = folder / ".complete"
    if done.exists():
        return folder
    per = np.full(n_classes, n_files // n_classes)
    per[: n_files % n_classes] += 1
    for c, k in enumerate(per):
        wnid = f"n{1440764 + 7919 * c:08d}"
        d = folder / "train" / wnid
        d.mkdir(parents=True, exist_ok=True)
        for j in range(k):
            open(d / f"{wnid}_{j}.JPEG", "wb").close()
    done.write_text("")
    return folder


# --- child measurements (a fresh interpreter each) --------------------------------------------------------
def _peak_mib() -> float:
    """This process's peak RSS, MiB: ``VmHWM`` (per address space, so reset by exec; ``ru_maxrss`` is not: it
    keeps the peak of the parent that forked us)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _imports():
    """Every module any measurement needs, imported before any clock starts (same baseline RSS for all)."""
    import faster_coco_eval  # noqa: F401
    import psutil  # noqa: F401
    import pycocotools.coco  # noqa: F401
    import pycocotools.cocoeval  # noqa: F401
    import torch  # noqa: F401

    import trainer.data.formats.coco  # noqa: F401
    import trainer.data.formats.coco_dataset  # noqa: F401
    import trainer.data.formats.imagefolder  # noqa: F401
    import trainer.data.loading  # noqa: F401
    import trainer.tasks.detection.evaluator  # noqa: F401


class _Touch:
    """Dataset over a split's per-sample metadata: item ``i`` reads what a real ``__getitem__`` reads before
    decoding (path, size, id, boxes; or ImageFolder's ``(path, label)``) and reports the worker's RSS/USS every
    ``every`` items (bytes)."""

    def __init__(self, split=None, samples=None):
        self.split, self.samples = split, samples
        self.every = max(1, len(self) // 50)

    def __len__(self):
        return len(self.split) if self.split is not None else len(self.samples)

    def __getitem__(self, key):
        _, i = key if isinstance(key, tuple) else (0, key)  # EpochSampler's (epoch, index) keys
        if self.split is not None:
            s = self.split
            path, (h, w), image_id = s.paths[i], s.sizes[i], s.image_ids[i]
            boxes, labels = s.targets(i)
            n = len(path) + h + w + image_id % 7 + len(boxes) + len(labels)
        else:
            path, label = self.samples[i]
            n = len(path) + label
        if not getattr(self, "_reported", False) or i % self.every == 0:  # first access in a worker, then every
            self._reported = True
            import psutil
            import torch

            info = torch.utils.data.get_worker_info()
            m = psutil.Process().memory_full_info()
            return n, (info.id if info else -1, m.rss, m.uss)
        return n, None


def _collate(items):
    return [m for _, m in items if m is not None]


def _epoch(ds, workers: int, batch: int = 512) -> dict:
    """One epoch of index accesses through the trainer's loader; per worker: (rss, uss) at its first report
    and at its last, MiB; and the time to the first batch (loader build + worker start), s."""
    from torch.utils.data import BatchSampler

    from trainer.data.loading import build_loader
    from trainer.data.sampler import EpochSampler

    t0 = time.perf_counter()
    order = EpochSampler(len(ds), shuffle=True, seed=0)
    order.set_epoch(0)
    loader = build_loader(
        ds,
        BatchSampler(order, batch, drop_last=False),
        _collate,
        num_workers=workers,
        prefetch_factor=2,
        pin_memory=False,
        persistent_workers=False,
    )
    it = iter(loader)
    reports = list(next(it))
    first_batch_s = time.perf_counter() - t0
    for b in it:
        reports += b
    t_epoch = time.perf_counter() - t0
    per = {}
    for wid, rss, uss in reports:
        per.setdefault(wid, []).append((rss / 2**20, uss / 2**20))
    workers_out = {
        str(w): {"rss_first": v[0][0], "rss_last": v[-1][0], "uss_first": v[0][1], "uss_last": v[-1][1]}
        for w, v in sorted(per.items())
    }
    return {"first_batch_s": first_batch_s, "epoch_s": t_epoch, "workers": workers_out}


def _legacy_coco(split):
    """The split as the reader held it before flat columns: Python lists of str / int / (h, w) tuples."""
    from dataclasses import replace

    return replace(split, paths=list(split.paths), image_ids=list(split.image_ids), sizes=list(split.sizes))


def child(mode: str, a: dict) -> dict:
    _imports()
    base = _rss_mib()
    t0 = time.perf_counter()
    out: dict = {}
    if mode == "json":
        with open(a["ann"], encoding="utf-8") as f:
            data = json.load(f)
        out["n_images"] = len(data["images"])
    elif mode == "pycocotools":
        import contextlib
        import io

        from pycocotools.coco import COCO

        with contextlib.redirect_stdout(io.StringIO()):
            data = COCO(a["ann"])
    elif mode in ("scan", "scan_build", "scan_hit"):
        from trainer.data.formats.coco import scan_coco

        cache = a["cache"] if mode != "scan" else None
        split = scan_coco(a["ann"], a["images"], "train", cache_dir=cache)
        out["boxes"] = int(len(split.boxes))
    elif mode == "startup":
        from trainer.data.formats.coco import scan_coco

        split = scan_coco(a["ann"], a["images"], "train", cache_dir=a.get("cache"))
        counts = np.diff(split.box_start)
        assert int(counts.max()) <= 900  # the num_queries check of build_data
        out["scan_s"] = time.perf_counter() - t0
        if a.get("legacy"):
            split = _legacy_coco(split)
        r = _epoch(_Touch(split=split), a["workers"])
        out.update(r)
        out["startup_s"] = out["scan_s"] + r["first_batch_s"]
    elif mode == "imagefolder":
        from trainer.data.formats.imagefolder import scan_split

        scan = scan_split(a["root"], "train")
        out["scan_s"] = time.perf_counter() - t0
        samples = list(scan.samples) if a.get("legacy") else scan.samples
        r = _epoch(_Touch(samples=samples), a["workers"])
        out.update(r)
        out["startup_s"] = out["scan_s"] + r["first_batch_s"]
    elif mode == "eval":
        out.update(_eval(a))
    out.setdefault("seconds", time.perf_counter() - t0)
    out["base_rss_mib"], out["peak_rss_mib"] = base, _peak_mib()
    return out


def _eval(a: dict) -> dict:
    """pycocotools vs faster-coco-eval vs CocoEvaluator on 5,000 val images x 100 detections (seconds)."""
    import contextlib
    import io

    import torch
    from faster_coco_eval import COCO as FCOCO
    from faster_coco_eval import COCOeval_faster
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from trainer.tasks.detection.evaluator import CocoEvaluator

    ann = Path(a["ann"])
    data = json.loads(ann.read_text())
    rng = np.random.default_rng(1)
    by_img: dict = {im["id"]: [] for im in data["images"]}
    for x in data["annotations"]:
        by_img[x["image_id"]].append(x)
    cat_ids = sorted(c["id"] for c in data["categories"])
    records = []
    for im in data["images"]:
        rows = []
        for x in by_img[im["id"]][:EVAL_DETS]:
            bx, by, bw, bh = x["bbox"]
            j = rng.normal(0, 0.1, 4) * [bw, bh, bw, bh]
            rows.append([bx + j[0], by + j[1], bw + j[2], bh + j[3], float(rng.random()), x["category_id"]])
        while len(rows) < EVAL_DETS:
            bx, by = rng.random() * (im["width"] - 40), rng.random() * (im["height"] - 40)
            rows.append(
                [bx, by, 10 + 30 * rng.random(), 10 + 30 * rng.random(), 0.5 * rng.random(), int(rng.choice(cat_ids))]
            )
        records.append((im["id"], rows))
    dets = np.asarray([[i, *r] for i, rows in records for r in rows], dtype=np.float64)
    out = {"detections": len(dets)}
    quiet = contextlib.redirect_stdout(io.StringIO())
    for name, coco_cls, eval_cls, kw in (
        ("pycocotools", COCO, COCOeval, {}),
        ("faster_coco_eval", FCOCO, COCOeval_faster, {"print_function": lambda *x, **y: None}),
    ):
        with quiet:
            gt = coco_cls(str(ann))
            t = time.perf_counter()
            ev = eval_cls(gt, gt.loadRes(dets.copy()), iouType="bbox", **kw)
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
            out[f"{name}_s"] = time.perf_counter() - t
            out[f"{name}_map"] = float(ev.stats[0])
    cats = [c["name"] for c in sorted(data["categories"], key=lambda c: c["id"])]
    ev = CocoEvaluator(ann, tuple(cat_ids), tuple(cats))
    for image_id, rows in records:
        r = np.asarray(rows, dtype=np.float64).reshape(-1, 6)
        boxes = torch.tensor(np.c_[r[:, :2], r[:, :2] + r[:, 2:4]], dtype=torch.float64)
        labels = torch.tensor([cat_ids.index(int(c)) for c in r[:, 5]])
        ev.update([{"boxes": boxes, "scores": torch.tensor(r[:, 4]), "labels": labels}], {"image_ids": [image_id]})
    ev._ground_truth()  # read the JSON first, as the two above (their COCO(file) is outside the clock too)
    t = time.perf_counter()
    m = ev.compute()
    out["trainer_s"] = time.perf_counter() - t
    out["trainer_map"] = m["map"] / 100
    return out


def run_child(mode: str, **a) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, json.dumps(a, default=str)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"scale: child {mode} {a} failed:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {mode:12s} {json.dumps(a, default=str)[:90]}: {json.dumps(r)[:300]}", flush=True)
    return r


# --- the run ----------------------------------------------------------------------------------------------
def fit_exponent(xs, ys) -> float:
    """b of y ~ x^b, least squares on log-log (nan with fewer than two sizes)."""
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.25,1,4", help="multiples of COCO train2017 (118,287 images)")
    ap.add_argument("--imagenet", default="0.1,1", help="multiples of ImageNet train (1,281,167 files); '' = none")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/scale-data"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--legacy-too", action="store_true", help="also measure workers with Python lists (before)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"coco": {}, "imagenet": {}, "eval": None, "machine": _machine(), "date": time.strftime("%Y-%m-%d")}
    for s in [float(x) for x in args.sizes.split(",") if x]:
        n = round(COCO_IMAGES * s)
        t = time.perf_counter()
        folder = args.work / f"coco-{n}"
        ann = make_coco(folder, n)
        print(
            f"coco x{s:g}: {n:,} images, {ann.stat().st_size / 1e6:.0f} MB ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        cache = folder / "cache"
        if cache.exists():
            import shutil

            shutil.rmtree(cache)
        common = {"ann": ann, "images": folder / "images"}
        r = {
            "images": n,
            "json_mb": ann.stat().st_size / 1e6,
            "json": run_child("json", **common),
            "pycocotools": run_child("pycocotools", **common),
            "scan": run_child("scan", **common),
            "scan_build": run_child("scan_build", cache=cache, **common),
            "scan_hit": run_child("scan_hit", cache=cache, **common),
            "startup": run_child("startup", cache=cache, workers=args.workers, **common),
        }
        if args.legacy_too:
            r["startup_legacy"] = run_child("startup", cache=cache, workers=args.workers, legacy=True, **common)
        res["coco"][str(s)] = r
        _write(args.out, res)
    for s in [float(x) for x in args.imagenet.split(",") if x]:
        n = round(IMAGENET_FILES * s)
        t = time.perf_counter()
        root = make_imagefolder(args.work / f"imagenet-{n}", n)
        print(f"imagenet x{s:g}: {n:,} files ({time.perf_counter() - t:.0f} s)", flush=True)
        r = {"files": n, "new": run_child("imagefolder", root=root, workers=args.workers)}
        if args.legacy_too:
            r["legacy"] = run_child("imagefolder", root=root, workers=args.workers, legacy=True)
        res["imagenet"][str(s)] = r
        _write(args.out, res)
    if not args.skip_eval:
        ann = make_coco(args.work / f"coco-val-{EVAL_IMAGES}", EVAL_IMAGES, seed=7, files=False)
        res["eval"] = run_child("eval", ann=ann)
    _write(args.out, res)
    print((args.out / "table.md").read_text())
    return 0


def _machine() -> str:
    try:
        cpu = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name"))
        cpu = cpu.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        cpu = "unknown CPU"
    return f"{cpu}, {os.cpu_count()} vCPU, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB"


def _write(out: Path, res: dict) -> None:
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "table.md").write_text(table(res))
    try:
        plot(res, out / "scale.png")
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the figure
        print(f"scale: no plot ({e})")


def _series(res: dict) -> dict:
    """name -> (sizes, values, unit) over the COCO sizes run."""
    coco = res["coco"]
    xs = [float(s) for s in coco]
    pick = {
        "json.load, s": lambda r: r["json"]["seconds"],
        "pycocotools COCO(), s": lambda r: r["pycocotools"]["seconds"],
        "scan_coco, no cache, s": lambda r: r["scan"]["seconds"],
        "scan_coco, filling the cache, s": lambda r: r["scan_build"]["seconds"],
        "scan_coco, cache hit, s": lambda r: r["scan_hit"]["seconds"],
        "start-up to first batch (cache hit), s": lambda r: r["startup"]["startup_s"],
        "json.load peak RSS above imports, MiB": lambda r: _above(r["json"]),
        "pycocotools peak RSS above imports, MiB": lambda r: _above(r["pycocotools"]),
        "scan_coco (no cache) peak RSS above imports, MiB": lambda r: _above(r["scan"]),
        "scan_coco (filling the cache) peak RSS above imports, MiB": lambda r: _above(r["scan_build"]),
        "scan_coco (cache hit) peak RSS above imports, MiB": lambda r: _above(r["scan_hit"]),
        "rank peak RSS at first batch (cache hit), MiB": lambda r: r["startup"]["peak_rss_mib"],
        "worker USS after an epoch, MiB": lambda r: max(w["uss_last"] for w in r["startup"]["workers"].values()),
        "worker USS growth over the epoch, MiB": lambda r: max(
            w["uss_last"] - w["uss_first"] for w in r["startup"]["workers"].values()
        ),
    }
    return {k: (xs, [f(r) for r in coco.values()]) for k, f in pick.items()}


#: The table cell where no exponent can be fitted: a single size, or a non-positive figure (no log).
_NO_FIT = "– (needs two sizes > 0)"


def _exponent_cell(b: float) -> str:
    """``b`` to two decimals, or :data:`_NO_FIT` when it is nan (one size only: ``--sizes 1``)."""
    return f"{b:.2f}" if np.isfinite(b) else _NO_FIT


def _above(r: dict) -> float:
    """Peak RSS minus the RSS after the imports (MiB): what the measured call itself cost."""
    return r["peak_rss_mib"] - r["base_rss_mib"]


def table(res: dict) -> str:
    lines = [f"Machine: {res['machine']}; date {res['date']}.", ""]
    coco = res["coco"]
    if coco:
        sizes = list(coco)
        head = " | ".join(f"{float(s):g}x ({coco[s]['images']:,} img, {coco[s]['json_mb']:.0f} MB)" for s in sizes)
        lines += [f"| COCO train size | {head} | exponent b | 15x (Objects365) |", "|---" * (len(sizes) + 3) + "|"]
        for name, (xs, ys) in _series(res).items():
            b = fit_exponent(xs, ys) if all(y > 0 for y in ys) else float("nan")
            ext = ys[-1] * (15 / xs[-1]) ** b if np.isfinite(b) and xs[-1] != 15 else float("nan")
            vals = " | ".join(f"{y:,.2f}" if y < 100 else f"{y:,.0f}" for y in ys)
            ext_cell = f"{ext:,.0f} (extrapolated)" if np.isfinite(ext) else _NO_FIT
            lines.append(f"| {name} | {vals} | {_exponent_cell(b)} | {ext_cell} |")
        if any("startup_legacy" in r for r in coco.values()):
            lines += ["", "| worker RSS / USS, MiB: first report -> after the epoch | " + " | ".join(sizes) + " |"]
            lines.append("|---" * (len(sizes) + 1) + "|")
            for key, name in (("startup_legacy", "lists (before)"), ("startup", "flat columns (now)")):
                cells = []
                for r in coco.values():
                    w = r.get(key, {}).get("workers", {}).get("0")
                    cells.append(
                        f"{w['rss_first']:.0f} -> {w['rss_last']:.0f} / {w['uss_first']:.0f} -> {w['uss_last']:.0f}"
                        if w
                        else "-"
                    )
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    inet = res["imagenet"]
    if inet:
        lines += ["", "| ImageFolder | " + " | ".join(f"{r['files']:,} files" for r in inet.values()) + " | b |"]
        lines.append("|---" * (len(inet) + 2) + "|")
        xs = [float(s) for s in inet]
        rows = {
            "scan_split, s": lambda r: r["new"]["scan_s"],
            "rank peak RSS, MiB": lambda r: r["new"]["peak_rss_mib"],
            "worker USS after an epoch (flat), MiB": lambda r: r["new"]["workers"]["0"]["uss_last"],
            "worker USS growth over the epoch (flat), MiB": lambda r: r["new"]["workers"]["0"]["uss_last"]
            - r["new"]["workers"]["0"]["uss_first"],
        }
        if all("legacy" in r for r in inet.values()):
            rows["worker USS after an epoch (lists, before), MiB"] = lambda r: r["legacy"]["workers"]["0"]["uss_last"]
            rows["worker USS growth over the epoch (lists, before), MiB"] = (
                lambda r: r["legacy"]["workers"]["0"]["uss_last"] - r["legacy"]["workers"]["0"]["uss_first"]
            )
        for name, f in rows.items():
            ys = [f(r) for r in inet.values()]
            b = fit_exponent(xs, ys) if all(y > 0 for y in ys) else float("nan")
            lines.append(f"| {name} | " + " | ".join(f"{y:,.1f}" for y in ys) + f" | {_exponent_cell(b)} |")
    ev = res.get("eval")
    if ev:
        lines += [
            "",
            f"COCO evaluation, {EVAL_IMAGES:,} images x {EVAL_DETS} detections ({ev['detections']:,}): "
            f"pycocotools {ev['pycocotools_s']:.1f} s (mAP {ev['pycocotools_map']:.6f}), faster-coco-eval "
            f"{ev['faster_coco_eval_s']:.1f} s (mAP {ev['faster_coco_eval_map']:.6f}), the trainer's CocoEvaluator "
            f"{ev['trainer_s']:.1f} s (mAP {ev['trainer_map']:.6f}).",
        ]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not res["coco"]:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, (xs, ys) in _series(res).items():
        if "growth" in name:
            continue
        ax = a1 if name.endswith(", s") else a2
        ax.plot(xs, ys, "o-", label=name.rsplit(",", 1)[0])
    for ax, unit in ((a1, "seconds"), (a2, "MiB")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("dataset size, multiples of COCO train2017 (118,287 images)")
        ax.set_ylabel(unit)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    a1.set_title("start-up costs")
    a2.set_title("host memory per rank / worker")
    fig.suptitle(f"benchmarks/scale.py, {res['machine']}, {res['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], json.loads(sys.argv[3]))))
        sys.exit(0)
    sys.exit(main())
