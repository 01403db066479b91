"""Clips per second that ONE DataLoader worker (one process, torch at 1 thread) decodes: windows of 32 frames at
stride 2 (63 frames spanned), resized (shorter side 64, antialiased) and centre-cropped to 64 x 64, from every
clip in ``../shared/data/video-clips``, with PyAV (the trainer's reader) and torchcodec.

Each sample opens the file afresh (a worker keeps no open containers) and reads a window starting where
``clip_indices(..., "random", seed)`` puts it for seeds 0, 1, 2 ... (the same windows for every decoder, which
take turns window by window, so that load from other processes on the machine falls on all of them alike).
Decoders:

* ``pyav``: :func:`trainer.data.formats.video.read_frames` (decodes from the start, FFmpeg threads = 1);
* ``pyav-auto``: the same with ``thread_type="AUTO"`` and FFmpeg's own thread count;
* ``torchcodec-exact`` / ``torchcodec-approx``: ``VideoDecoder(seek_mode=..., num_ffmpeg_threads=1)``,
  ``get_frames_at(indices)``, then the same resize + crop. ``exact`` scans the file at open; ``approximate``
  trusts the header (tree.avi: 444 frames claimed, 68 real, so its windows can fall past the end).

``|diff|`` is the mean absolute difference (0-255) of each decoder's clip from PyAV's for the same window:
~0-1 means the same frames (colour conversion differs slightly), tens means other frames.

torchcodec 0.17 needs FFmpeg's shared libraries (Debian: ``apt-get install -y ffmpeg``) and is not a trainer
dependency: ``.venv/bin/pip install torchcodec==0.17.0`` for this benchmark only. Usage:
``.venv/bin/python benchmarks/video_decoders.py [--clips DIR] [--seconds 2]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.formats.video import clip_indices, fit_frames, probe_video, read_frames  # noqa: E402

T, STRIDE, SIZE = 32, 2, 64


def _torchcodec(mode: str):
    from torchcodec.decoders import VideoDecoder

    def read(path: str, idx: list[int]) -> torch.Tensor:
        dec = VideoDecoder(path, seek_mode=mode, num_ffmpeg_threads=1, dimension_order="NCHW")
        return fit_frames(dec.get_frames_at(idx).data, SIZE)

    return read


def decoders() -> dict:
    """name -> (callable(path, indices) -> uint8 (T, 3, SIZE, SIZE), or the reason it cannot run)."""
    out = {
        "pyav": lambda p, i: read_frames(p, i, SIZE, threads=1),
        "pyav-auto": lambda p, i: read_frames(p, i, SIZE, threads=0),
    }
    try:
        import torchcodec  # noqa: F401

        for mode, name in (("exact", "torchcodec-exact"), ("approximate", "torchcodec-approx")):
            out[name] = _torchcodec(mode)
    except Exception as e:  # noqa: BLE001 - not installed, or FFmpeg's libraries missing
        out["torchcodec"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return out


def bench(reads: dict, path: str, n: int, seconds: float) -> dict[str, tuple[float, float | str]]:
    """name -> (clips/s, mean |diff| from PyAV) for the decoders ``reads``, taking turns window by window (seeds
    0, 1, ...) so that load from other processes falls on all of them alike; at least ``seconds`` each."""
    spent = dict.fromkeys(reads, 0.0)
    diffs: dict[str, list[float]] = {k: [] for k in reads}
    failed: dict[str, str] = {}
    rounds = 0
    while rounds < 3 or min(spent.values()) < seconds:
        idx = clip_indices(n, T, STRIDE, "random", rounds, "pad")
        ref = read_frames(path, idx, SIZE) if rounds < 3 else None
        for name, read in reads.items():
            if name in failed:
                continue
            t0 = time.perf_counter()
            try:
                clip = read(path, idx)
            except Exception as e:  # noqa: BLE001 - reported in the table
                failed[name] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
                spent[name] = float("inf")
                continue
            spent[name] += time.perf_counter() - t0
            if ref is not None:
                diffs[name].append((clip.float() - ref.float()).abs().mean().item())
        rounds += 1
        if len(failed) == len(reads):
            break
    return {k: (0.0, failed[k]) if k in failed else (rounds / spent[k], sum(diffs[k]) / len(diffs[k])) for k in reads}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - lscpu missing
        model = "unknown"
    return f"{model}, {os.cpu_count()} logical CPUs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", default=str(Path(__file__).resolve().parents[2] / "shared/data/video-clips"))
    ap.add_argument("--seconds", type=float, default=2.0, help="minimum time per decoder and clip")
    args = ap.parse_args()
    torch.set_num_threads(1)  # what a DataLoader worker runs with
    import av

    print(f"CPU: {cpu_model()}; torch {torch.__version__}, PyAV {av.__version__}", end="")
    try:
        import torchcodec

        print(f", torchcodec {torchcodec.__version__}")
    except Exception:  # noqa: BLE001
        print(", torchcodec not installed")
    print(f"{T}-frame windows at stride {STRIDE}, {SIZE} px, one process, torch threads 1\n")
    print("| decoder | clip | codec | frames | clips/s | \\|diff\\| vs pyav |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    totals: dict[str, list[float]] = {}
    paths = sorted(p for p in Path(args.clips).iterdir() if p.is_file())
    reads = decoders()
    for name, why in reads.items():
        if isinstance(why, str):
            print(f"| {name} | all | - | - | cannot run | {why} |")
    reads = {k: v for k, v in reads.items() if not isinstance(v, str)}
    rows = {}
    for p in paths:
        info = probe_video(p)
        for name, (rate, diff) in bench(reads, str(p), info.num_frames, args.seconds).items():
            d = f"{diff:.2f}" if isinstance(diff, float) else diff
            rows.setdefault(name, []).append(
                f"| {name} | {p.name} | {info.codec} | {info.num_frames} | {rate:.1f} | {d} |"
            )
            totals.setdefault(name, []).append(1 / rate if rate else float("inf"))
    for name in rows:
        print("\n".join(rows[name]))
    print("\nOne clip of each file in turn (harmonic mean of the rows above):\n")
    print("| decoder | clips/s |\n| --- | ---: |")
    for name, secs in totals.items():
        print(f"| {name} | {len(secs) / sum(secs):.1f} |")


if __name__ == "__main__":
    main()
