"""GPU busy % of a training run over its epoch window, from ``nvidia-smi --query-gpu=timestamp,memory.used,
utilization.gpu --format=csv -lms 500`` samples and the run's log.

The window starts at the first sample at >= 5 % busy among those with memory in use and lasts the epoch's
``epoch_time_s`` (the trainer's epoch line), so process start-up, evaluation and shutdown do not dilute it.
Prints one line: ``busy NN.N % over the epoch (N samples); NN.N % over the whole run (N samples)``.

    python benchmarks/gpu_busy.py SMI_CSV TRAIN_LOG
Exit 2 with one line when a file is missing or holds no samples or no epoch line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def busy(smi_csv: Path, log: Path, interval_s: float = 0.5) -> tuple[float, int, float, int]:
    """(epoch-window busy %, its samples, whole-run busy %, its samples); raises ValueError naming what is missing."""
    util = []
    for line in smi_csv.read_text().splitlines()[1:]:
        parts = [p.strip() for p in line.split(",")]
        try:
            mem, pct = float(parts[1].split()[0]), float(parts[2].split()[0])
        except (IndexError, ValueError):
            continue
        if mem > 1000:
            util.append(pct)
    times = re.findall(r"epoch_time_s=([0-9.]+)", log.read_text())
    if not util or not times:
        raise ValueError(f"{smi_csv if not util else log}: no GPU samples with memory in use or no epoch_time_s")
    start = next((i for i, u in enumerate(util) if u >= 5), 0)
    window = util[start : start + max(1, int(float(times[0]) / interval_s))]
    return sum(window) / len(window), len(window), sum(util) / len(util), len(util)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: gpu_busy.py SMI_CSV TRAIN_LOG", file=sys.stderr)
        return 2
    try:
        w, nw, a, na = busy(Path(argv[0]), Path(argv[1]))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"busy {w:.1f} % over the epoch ({nw} samples); {a:.1f} % over the whole run ({na} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
