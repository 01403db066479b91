"""Host RAM of video training jobs side by side: measured vs ``plan``'s prediction (trainer/planning/host_ram.py).

Writes seed 004-shaped clip arrays (``--clips`` random uint8 clips of 32 x 64 x 64 x 3 in ``train.npz``, 10 %
as many in ``val.npz``; ``np.savez``: stored members, memory-mapped in place and shared through the page cache,
or with ``--compressed`` ``np.savez_compressed``: decompressed into every reading process), then starts K = 1..``--max-jobs`` independent ``python -m trainer train`` jobs at once (task video, the frozen
ResNet-18 + Transformer of configs/seed004_video_g5.yaml, batch 16, 1 loader worker, CPU, fp32, uncached frames)
and samples every job's process tree every 0.2 s: the peak of the summed PSS (``/proc/<pid>/smaps_rollup``;
proportional set size, so pages shared between a job's main process and its forked workers, or between jobs,
count once in total) per job. The prediction is ``predict_host_ram`` for a CPU process (its assumed
``CPU_PROCESS_HOST_BYTES``) with the dataset bytes the task reports for the scanned data.

    PYTHONPATH=. .venv/bin/python benchmarks/video_host_ram.py --clips 1000 --max-jobs 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def _rollup(pid: int) -> dict[str, int]:
    """Bytes per field of ``/proc/<pid>/smaps_rollup`` (Pss, Private_Dirty, ...); empty once the process is gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return out


def _pss(pid: int) -> int:
    return _rollup(pid).get("Pss", 0)


def _write_arrays(root: Path, clips: int, seed: int = 0, compressed: bool = False) -> None:
    rng = np.random.default_rng(seed)
    save = np.savez_compressed if compressed else np.savez
    for split, n in (("train", clips), ("val", max(clips // 10, 16))):
        x = rng.integers(0, 256, size=(n, 32, 64, 64, 3), dtype=np.uint8)
        save(root / f"{split}.npz", clips=x, labels=rng.integers(0, 10, size=n))


def _config(root: Path, out: Path, steps: int) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "seed004_video_g5.yaml").read_text())
    cfg["optim"] = {**cfg["optim"], "warmup_epochs": 0}
    cfg.update(
        data_dir=str(root),
        epochs=1,
        max_steps_per_epoch=steps,
        device="cpu",
        checkpoint_dir=str(out / "ck"),
        log_dir=str(out / "logs"),
        log_every_steps=1000,
    )
    cfg["speed"] = {"precision": "32", "channels_last": False}
    cfg["video"] = {**cfg["video"], "cache_features": False}
    path = out / "c.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def _predicted(config: Path, jobs: int) -> tuple[float, float]:
    import torch

    from trainer.config import load_config
    from trainer.engine.distributed import DistInfo
    from trainer.planning.host_ram import GIB, predict_host_ram
    from trainer.tasks import build_task

    cfg = load_config(config)
    task = build_task(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    data = task.build_data()
    pred = predict_host_ram(
        micro_batch=cfg.batch_size,
        bytes_per_sample=task.loader_sample_bytes(),
        num_workers=cfg.num_workers,
        prefetch_factor=cfg.prefetch_factor,
        jobs=jobs,
        device_type="cpu",
        pin_memory=cfg.pin_memory,
        persistent_workers=cfg.persistent_workers,
        dataset_bytes=task.host_data_bytes(data),
    )
    return pred.per_job_bytes / GIB, pred.page_cache_bytes / GIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clips", type=int, default=1000)
    ap.add_argument("--max-jobs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compressed", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="video-ram-"))
    _write_arrays(tmp, args.clips, compressed=args.compressed)
    print(f"arrays: {(tmp / 'train.npz').stat().st_size / 2**30:.2f} GiB train.npz ({args.clips} clips)")
    print("| jobs | per-job peak PSS measured (GiB) | per-job predicted (GiB) | host total measured (GiB) |")
    print("| ---: | --- | ---: | ---: |")
    for k in range(1, args.max_jobs + 1):
        configs = [_config(tmp, tmp / f"k{k}-job{j}", args.steps) for j in range(k)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "trainer", "train", "--config", str(c)],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for c in configs
        ]
        peaks, host_peak, per_process = [0] * k, 0, {}
        while any(p.poll() is None for p in procs):
            for q in _tree(procs[0].pid) if procs[0].poll() is None else []:
                r = _rollup(q)  # job 1's processes by pid (the main process first: the lowest pid)
                if r.get("Pss", 0) > per_process.get(q, {}).get("Pss", 0):
                    per_process[q] = r
            sizes = [sum(_pss(q) for q in _tree(p.pid)) if p.poll() is None else 0 for p in procs]
            peaks = [max(a, b) for a, b in zip(peaks, sizes)]
            host_peak = max(host_peak, sum(sizes))
            time.sleep(0.2)
        for p in procs:
            if p.returncode:
                raise SystemExit(f"a job failed (exit {p.returncode}): {p.stderr.read()[-2000:]}")
        predicted, cache = _predicted(configs[0], k)
        print(
            f"| {k} | {', '.join(f'{b / 2**30:.2f}' for b in peaks)} | {predicted:.2f} (+ {cache:.2f} page cache "
            f"per host) | {host_peak / 2**30:.2f} |"
        )
        if k == 1:
            parts = ", ".join(
                f"process {pos} (pid {pid}): PSS {r.get('Pss', 0) / 2**20:,.0f} / private dirty {r.get('Private_Dirty', 0) / 2**20:,.0f}"
                for pos, (pid, r) in enumerate(sorted(per_process.items()))
            )
            print(f"|   | one job's processes at their peaks (MiB): {parts} | | |")


if __name__ == "__main__":
    main()
