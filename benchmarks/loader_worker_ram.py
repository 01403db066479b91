"""Host RAM of the trainer's loader workers and their fork server (``measure_loader``, as ``probe`` runs it).

hymenoptera's training split through the classification task's dataset at 64 px, batch 16, 8 batches, for 1, 2
and 4 workers. Prints ``workers, summed worker USS MiB, fork server anonymous MiB, per-worker overhead MiB,
images/s, fork server USS MiB``. With ``--fork`` the server is a fork of this process taken first, as
``python -m trainer train`` takes it (``fork_worker_server``); else a fresh interpreter. Usage:
``PYTHONPATH=. python benchmarks/loader_worker_ram.py [--fork] [DATA_DIR]`` (default ../shared/data).
"""

import sys
from pathlib import Path

from trainer.config import TrainConfig
from trainer.data.formats.imagefolder import ImageFolderDataset, scan_split
from trainer.data.loading import fork_worker_server, worker_server_pid
from trainer.data.samples import collate_skip_bad as collate
from trainer.planning.loader_probe import measure_loader, uss_bytes


def main():
    args = sys.argv[1:]
    if "--fork" in args:
        args.remove("--fork")
        assert fork_worker_server(), "the server could not be forked (another thread is alive)"
    root = Path(args[0] if args else "../shared/data")
    scan = scan_split(root / "hymenoptera", "train")
    from trainer.tasks.classification.task import _TrainTransformForEpoch

    ds = ImageFolderDataset(scan, _TrainTransformForEpoch(TrainConfig(image_size=64)))
    for w in (1, 2, 4):
        r = measure_loader(ds, collate, TrainConfig(), 16, w, 2, 8)
        print(
            w,
            round(r["workers_private_bytes"] / 2**20, 1),
            round(r["worker_server_bytes"] / 2**20, 1),
            round(r["worker_overhead_bytes"] / 2**20, 1),
            round(r["images_per_s"]),
            round(uss_bytes(worker_server_pid()) / 2**20, 1),
        )


if __name__ == "__main__":
    main()
