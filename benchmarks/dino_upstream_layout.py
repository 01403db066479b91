"""A DINO checkpoint in upstream's layout with COCO-style category ids, for ``evaluate --init-from`` and ``predict``
(the upstream-checkpoint figures of docs/benchmarks.md).

Writes under ``--out``: ``data/`` (the 4 facemask images of ``tests/tasks/test_detection_learning.py``, train x4 and
val x1, category ids 0/1/2 re-labelled 1/44/90), ``val171/`` (facemask's whole val split, re-labelled the same way,
as both splits), ``ck/`` (a tiny DINO overfit on ``data/`` with ``label_space: coco_ids``: 91 classes, as upstream's
``num_classes``), ``upstream_layout.pth`` (the best checkpoint's weights saved as upstream's main.py saves:
``{"model", "optimizer", "lr_scheduler", "epoch", "args"}``), ``eval.yaml`` and ``eval171.yaml`` (its config on
those two data sets), ``imgs/`` (the first 16 facemask val images, for ``predict``). Then, for example::

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dino_upstream_layout.py --out /tmp/up --seed 3
    python -m trainer evaluate --config /tmp/up/eval.yaml --init-from /tmp/up/upstream_layout.pth
    python -m trainer evaluate --config /tmp/up/eval171.yaml --init-from /tmp/up/upstream_layout.pth \\
        --eval-protocol upstream
    python -m trainer predict --checkpoint /tmp/up/ck --images /tmp/up/imgs --out /tmp/up/p8 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "tasks")]
from test_detection_learning import _cfg, overfit_data  # noqa: E402

from trainer.engine.distributed import DistInfo  # noqa: E402
from trainer.engine.trainer import Trainer  # noqa: E402

#: facemask's category ids -> COCO-style ids (the label space then runs to 90: 91 classes).
REMAP = {0: 1, 1: 44, 2: 90}


def relabel(data: dict) -> dict:
    """A COCO dict with its category ids mapped through :data:`REMAP`."""
    return {
        **data,
        "annotations": [dict(a, category_id=REMAP[a["category_id"]]) for a in data["annotations"]],
        "categories": [dict(c, id=REMAP[c["id"]]) for c in data["categories"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--shared-data", type=Path, default=REPO.parent / "shared" / "data")
    args = ap.parse_args()
    out, src = args.out, args.shared_data / "facemask-coco"
    data = overfit_data(args.shared_data, out / "data")
    for f in (out / "data" / "annotations").glob("*.json"):
        f.write_text(json.dumps(relabel(json.loads(f.read_text()))))
    cfg = _cfg(data, out, label_space="coco_ids", seed=args.seed)
    t = Trainer(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    t.fit()
    t.close()
    state = torch.load(t.ckpt.dir / t.ckpt.pointer("best") / "state.pt", map_location="cpu", weights_only=False)
    upstream_args = argparse.Namespace(modelname="dino", num_classes=91, dn_labelbook_size=91)
    torch.save(
        {"model": state["model"], "optimizer": {}, "lr_scheduler": {}, "epoch": cfg.epochs - 1, "args": upstream_args},
        out / "upstream_layout.pth",
    )
    config = {k: v for k, v in cfg.to_dict().items() if v is not None}
    (out / "eval.yaml").write_text(yaml.safe_dump(config))
    (out / "val171" / "annotations").mkdir(parents=True, exist_ok=True)
    val = relabel(json.loads((src / "annotations" / "custom_val.json").read_text()))
    for split in ("train", "val"):
        (out / "val171" / "annotations" / f"instances_{split}.json").write_text(json.dumps(val))
    config.update(data_dir=str(out / "val171"), coco_images=str(src / "val2017"), eval_batch_size=8)
    (out / "eval171.yaml").write_text(yaml.safe_dump(config))
    (out / "imgs").mkdir(exist_ok=True)
    for f in sorted((src / "val2017").glob("*.jpg"))[:16]:
        shutil.copy(f, out / "imgs" / f.name)
    print(f"wrote {out}: ck/, upstream_layout.pth, eval.yaml, eval171.yaml, imgs/", flush=True)


if __name__ == "__main__":
    main()
