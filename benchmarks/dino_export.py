"""DINO-4scale R50 through ``export --format onnx``'s path on the CPU: export seconds and file size, then each
facemask image alone at its own evaluation size through ONNX Runtime and through ``predict``'s own path
(:meth:`DetectionTask.predict`, ``own_size``): seconds per image, max |diff| of scores and boxes, and the share of
``predict``'s detections the export also gives (same label, IoU >= 0.9). Seeded random weights (no checkpoint can be
downloaded here): the graph and the sizes are DINO-4scale's (configs/dino_4scale_coco.yaml), the scores are not a
trained model's.

    PYTHONPATH=. .venv/bin/python benchmarks/dino_export.py --data ../shared/data/facemask-coco --images 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.dino_step import facemask_overrides  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.engine.distributed import DistInfo  # noqa: E402
from trainer.export import export_onnx  # noqa: E402
from trainer.tasks import build_task  # noqa: E402
from trainer.tasks.base import denormalize  # noqa: E402
from trainer.tasks.detection.export import match_detections  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="facemask-coco folder")
    ap.add_argument("--images", type=int, default=4, help="validation images compared (distinct sizes first)")
    ap.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    over = {**facemask_overrides(args.data), "device": "cpu", "num_workers": 0}
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "dino_4scale_coco.yaml"), over)
    task = build_task(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    names = json.loads((Path(args.data) / "annotations" / "custom_val.json").read_text())["categories"]
    model = task.build_model(len(names)).float().eval()
    module = task.export_module(model).eval()
    listed = json.loads((Path(args.data) / "annotations" / "custom_val.json").read_text())["images"]
    by_size: dict = {}
    for i in listed:  # one image per original size first, so the graph sees several sizes
        by_size.setdefault((i["height"], i["width"]), i)
    picks = (list(by_size.values()) + listed)[: args.images]
    files = [str(Path(args.data) / "val2017" / i["file_name"]) for i in picks]

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        t0 = time.perf_counter()
        opset = export_onnx(module, task.export_example(2), path, task, 18, task.export_metadata({"categories": []}))
        export_s = time.perf_counter() - t0
        size_mb = path.stat().st_size / 2**20
        batch = task.predict_inputs(files)
        t1 = time.perf_counter()
        with torch.no_grad():
            predicted = task.predict(model, batch)
        torch_s = (time.perf_counter() - t1) / batch["n"]
        pixels = denormalize(batch["image"])
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        rows, ort_s = [], 0.0
        for i, (h, w) in enumerate(batch["sizes"]):
            inputs = {"image": pixels[i : i + 1, :, :h, :w].numpy(), "image_size": np.array([[h, w]], dtype=np.int64)}
            t2 = time.perf_counter()
            scores, labels, boxes = sess.run(None, inputs)
            ort_s += time.perf_counter() - t2
            ref = predicted[i]
            wh = batch["orig_size"][i].flip(0).repeat(2).numpy()
            refs = [ref["scores"][None].numpy(), ref["labels"][None].numpy(), ref["boxes"][None].numpy()]
            matched, total = match_detections(refs, [scores, labels, boxes * wh])
            rows.append(
                (
                    (h, w),
                    float(np.abs(scores[0] - refs[0][0]).max()),
                    float(np.abs(boxes[0] * wh - refs[2][0]).max()),
                    matched,
                    total,
                )
            )
    print(f"export: DINO-4scale {cfg.model}, opset {opset}, {export_s:.1f} s, {size_mb:.1f} MiB, dynamic batch/H/W")
    print(f"predict (PyTorch, own size): {torch_s:.2f} s/image; ONNX Runtime: {ort_s / len(rows):.2f} s/image")
    print("| size (h x w) | max abs diff scores | max abs diff boxes (px) | detections matched |")
    print("|---|---:|---:|---:|")
    for (h, w), ds, db, m, t in rows:
        print(f"| {h} x {w} | {ds:.2g} | {db:.2g} | {m}/{t} |")


if __name__ == "__main__":
    main()
