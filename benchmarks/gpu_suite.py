"""Every GPU figure of the project in one command: run by ``benchmarks/gpu_suite.sh``.

Steps, each a benchmark script of this folder run as a subprocess under its own time limit (a step that fails or
runs out of time is reported as such; the others still run; with ``--small --device cpu`` each step runs in a
fork of this process, which imported torch once, unless ``--fresh-processes``):

1. ``op_tests``: ``tests/ops/test_msda_cuda.py`` (our deformable-attention op against its reference).
2. ``op_bench``: ``msda.py``: our op vs the PyTorch reference, fp32 and bf16 (its table is kept).
3. ``memory_*``: ``memory_prediction.py``: predicted vs measured peak memory (allocated, reserved) for every
   task: ResNet-50 classification, DINO-4scale R50 (seed 000), U-Net/ResNet-34 (seed 001's GPU config), seed
   004's frame Transformer; on a GPU, the CUDA context measured beside the catalog's figure.
4. ``speed_*``: ``overhead.py``: images/s of the trainer vs a bare PyTorch loop on the same in-memory batches:
   classification (ResNet-50 224 px, bf16 + channels_last and fp32), segmentation (seed 001's config at
   1024 px), video (seed 004's config on clips derived from ``video-clips``, with and without the feature cache).
5. ``checkpoint``: ``checkpoint.py``: the full cost of one periodic checkpoint in steps (``stall_steps``).
6. On CUDA only: ``jpeg_copies`` (imagenette-subset's training photos 8 times over, hard links), then
   ``speed_decode_cuda`` (the real loop from those JPEGs with ``--decode-device cuda``, 4 loader workers; its
   rate beside the in-memory one of ``speed_classification``), ``ffcv_write`` (``python -m trainer write-ffcv``
   of the copies) and ``speed_ffcv`` (seed 003's loader: ``overhead.py --ffcv-dir``, the trainer vs the bare
   loop, both reading the trainer's FFCV loader; needs the ffcv extra, carried as wheels by
   ``benchmarks/gpu_carry.py``).

Writes ``<out>/gpu_suite.md``: one summary table (figure, value, step) followed by the op and memory tables,
ready to paste into docs/benchmarks.md, and one log per step. ``--small`` shrinks every size (CPU check of the
suite itself: ``tests/test_gpu_suite.py`` runs ``--device cpu --small``).

    bash benchmarks/gpu_suite.sh --device cuda --data ../shared/data --out /tmp/gpu-suite     # about 8 minutes
    bash benchmarks/gpu_suite.sh --device cpu --small --data ../shared/data --out /tmp/gpu-suite-cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def plan(
    device: str, small: bool, data: Path, work: Path, precisions: str = "bf16-mixed,32"
) -> list[tuple[str, int, list[str]]]:
    """(step name, time limit in seconds, argv) of every step for ``device`` at full or ``small`` size;
    ``precisions``: those of ``speed_classification`` at full size."""
    py = [sys.executable]
    gpu = device == "cuda"
    inet, roofs, clips = str(data / "imagenette-subset"), str(data / "rid-roofs"), str(work / "clips" / "clip-source")
    mem = [*py, str(HERE / "memory_prediction.py"), "--device", device]
    speed = [*py, str(HERE / "overhead.py"), "--device", device]
    if small:
        mem_cases = [
            "--cases resnet18:4 --image-size 64 --precision 32",
            "--config configs/seed000_dino_floorplans.yaml --cases resnet50:1 --image-size 128 --num-outputs 2 "
            "--precision 32 --predict-only",
            "--config configs/seed001_roofs_gpu.yaml --cases unet:2 --image-size 64 --num-outputs 9 --precision 32 "
            "--predict-only",
            "--config configs/seed004_video_g5.yaml --cases frame_transformer:2 --image-size 32 --num-outputs 7 "
            "--precision 32 --predict-only",
        ]
        cls = f"--data {inet} --model resnet18 --size 64 --batch 4 --steps 2 --rounds 1"
        seg = "--size 64 --batch 2 --steps 2 --rounds 1"
        vid = "--batch 4 --steps 2 --rounds 1 --size 32"
        ckpt = "--model shufflenet_v2_x0_5 --size 32 --batch 4 --steps 10 --every 4 --signal-after 2 --rounds 1"
        frames, px = 8, 32
    else:
        mem_cases = [
            "--cases resnet50:64,256;convnext_tiny:128 --precision bf16-mixed",
            "--config configs/seed000_dino_floorplans.yaml --cases resnet50:2 --image-size 0 --num-outputs 2 "
            "--precision bf16-mixed",
            "--config configs/seed001_roofs_gpu.yaml --cases unet:16 --image-size 1024 --num-outputs 9 "
            "--precision bf16-mixed",
            "--config configs/seed004_video_g5.yaml --cases frame_transformer:16 --image-size 64 --num-outputs 7 "
            "--precision bf16-mixed",
        ]
        cls = f"--data {inet} --model resnet50 --size 224 --batch 256 --steps 20 --rounds 3 --precisions {precisions}"
        seg = "--size 1024 --batch 16 --steps 10 --rounds 2 --precisions bf16-mixed"
        vid = "--batch 16 --steps 10 --rounds 2 --precisions bf16-mixed --size 64"
        ckpt = "--model resnet50 --size 224 --batch 256 --steps 39 --every 10 --signal-after 15 --rounds 2"
        frames, px = 32, 64
    mem_cases = [c.split() for c in mem_cases]
    cls, seg, vid, ckpt = cls.split(), seg.split(), vid.split(), ckpt.split()
    steps = [
        ("op_tests", 150, [*py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ops/test_msda_cuda.py"]),
        (
            "op_bench",
            120,
            [*py, str(HERE / "msda.py"), "--device", device, "--dtypes", "fp32,bf16"]
            + (["--small", "--iters", "2", "--warmup", "1"] if small else ["--iters", "10"]),
        ),
    ]
    for name, case in zip(("classification", "detection", "segmentation", "video"), mem_cases):
        steps.append((f"memory_{name}", 150 if gpu else 300, [*mem, *case]))
    steps += [
        ("speed_classification", 150 if gpu else 300, [*speed, *cls]),
        (
            "speed_segmentation",
            120 if gpu else 300,
            [*speed, "--config", "configs/seed001_roofs_gpu.yaml", "--data", roofs, *seg],
        ),
        (
            "clips",
            120,
            [
                *py,
                "-c",
                _CLIPS.format(videos=str(data / "video-clips"), out=str(work / "clips"), frames=frames, size=px),
            ],
        ),
        *(
            (
                f"speed_video_{'cached' if cached else 'uncached'}",
                120 if gpu else 300,
                [
                    *speed,
                    "--config",
                    "configs/seed004_video_g5.yaml",
                    "--data",
                    clips,
                    "--set",
                    f"num_frames={frames}",
                    "--set",
                    f"cache_features={str(cached).lower()}",
                    *vid,
                ],
            )
            for cached in (True, False)
        ),
        (
            "checkpoint",
            180 if gpu else 300,
            [*py, str(HERE / "checkpoint.py"), "--device", device, "--data", inet, *ckpt],
        ),
    ]
    if gpu:
        copies = work / "imagenette-x8"
        steps += [
            ("jpeg_copies", 60, [*py, "-c", _COPIES.format(src=inet, out=str(copies), copies=8)]),
            (
                "speed_decode_cuda",
                240,
                [
                    *py,
                    "-m",
                    "trainer",
                    "train",
                    "--data-dir",
                    str(copies),
                    *"--model resnet50 --image-size 224 --batch-size 256 --lr 0.1 --epochs 2 --precision bf16-mixed "
                    "--channels-last --decode-device cuda --num-workers 4 --device cuda --log-every-steps 20 "
                    "--no-auto-resume".split(),
                    "--checkpoint-dir",
                    str(work / "decode" / "ck"),
                    "--log-dir",
                    str(work / "decode" / "logs"),
                ],
            ),
            (
                "ffcv_write",
                90,
                [*py, "-m", "trainer", "write-ffcv", "--data-dir", str(copies), "--ffcv-dir", str(work / "ffcv")]
                + "--max-resolution 256 --num-workers 16".split(),
            ),
            (
                "speed_ffcv",
                150,
                [*speed, "--data", str(copies), "--ffcv-dir", str(work / "ffcv")]
                + "--model resnet50 --size 224 --batch 256 --workers 12 --rounds 2 --precisions bf16-mixed".split(),
            ),
        ]
    return steps


_CLIPS = (
    "import glob; from trainer.data.formats.video.derived import write_clip_sets; "
    "print(write_clip_sets(sorted(glob.glob('{videos}/*.mp4')), '{out}', num_frames={frames}, stride=1, size={size}))"
)


_COPIES = (
    "import os, pathlib, shutil; src, out = pathlib.Path('{src}'), pathlib.Path('{out}'); n = 0\n"
    "for split, k in (('train', {copies}), ('val', 1)):\n"
    "    for f in sorted((src / split).glob('*/*')):\n"
    "        for i in range(k):\n"
    "            d = out / split / f.parent.name; d.mkdir(parents=True, exist_ok=True)\n"
    "            t = d / f'r{{i}}_{{f.name}}'\n"
    "            if not t.exists():\n"
    "                try: os.link(f, t)\n"
    "                except OSError: shutil.copyfile(f, t)\n"
    "            n += 1\n"
    "print(n, 'files linked under', out)"
)


def run_step(name: str, limit: int, argv: list[str], out: Path, forked: bool = False) -> dict:
    """Run one step from the repository root with the repository first on ``PYTHONPATH`` (what was there, e.g.
    carried wheels installed with ``pip --target``, stays after it); its output goes to ``<out>/<name>.log``.
    ``forked``: in a fork of this process (see :func:`_run_forked`) instead of a fresh interpreter."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *extra]), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    if forked:
        rc, text = _run_forked(argv, limit, env, out / f"{name}.out")
    else:
        try:
            proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    secs = time.perf_counter() - t0
    (out / f"{name}.log").write_text(" ".join(argv) + "\n\n" + text)
    print(f"=== {name}: rc={rc} in {secs:.0f} s (limit {limit} s)", flush=True)
    return {"name": name, "rc": rc, "secs": secs, "text": text, "argv": argv}


def _preimport() -> None:
    """Import what every step imports (torch, torchvision, the trainer, pytest) once, before the steps are forked:
    ``--small --device cpu`` (the CPU check of the suite) then pays the ~5-7 s interpreter and torch start-up
    once instead of once per step. Nothing here starts a thread, so forking afterwards is safe."""
    import pytest  # noqa: F401
    import torch  # noqa: F401
    import torchvision  # noqa: F401

    import trainer.engine.trainer  # noqa: F401
    import trainer.planning.memory  # noqa: F401


def _run_forked(argv: list[str], limit: int, env: dict, capture: Path) -> tuple[int | str, str]:
    """Run ``argv`` (``[python, script, ...]``, ``[python, "-m", module, ...]`` or ``[python, "-c", code]``) in a
    fork of this process, as the interpreter would run it (``__main__``, ``sys.argv``, ``sys.path[0]``, the
    environment, the repository root as working directory), stdout and stderr into ``capture``; its process group
    is killed after ``limit`` seconds. Returns (exit status or "timeout", output)."""

    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from tests.forkserver import exit_like_the_interpreter, run_as_main, wait_child

    sys.stdout.flush()
    sys.stderr.flush()
    with open(capture, "wb") as f:
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.setpgid(0, 0)
                os.dup2(f.fileno(), 1)
                os.dup2(f.fileno(), 2)
                sys.stdout.reconfigure(line_buffering=True)
                sys.stderr.reconfigure(line_buffering=True)
                os.environ.clear()
                os.environ.update(env)
                code = run_as_main(argv, ROOT)
            finally:
                exit_like_the_interpreter(code)
    rc = wait_child(pid, limit)
    rc = "timeout" if rc is None else rc
    text = capture.read_text(errors="replace")
    capture.unlink()
    return rc, text


def summarize(results: list[dict]) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Summary rows (figure, value, step) and the detail tables (Markdown lines) from the steps' outputs."""
    rows, tables = [], []
    for r in results:
        name, text = r["name"], r["text"]
        if isinstance(r["rc"], str) and r["rc"].startswith("skipped"):
            rows.append((name, "not run: the --budget was spent", name))
            continue
        if r["rc"] != 0:
            last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            rows.append((name, f"FAILED (rc={r['rc']}): {last[0][:160]}", name))
            continue
        if name == "op_tests":
            m = re.findall(r"(\d+) (passed|skipped|failed)", text)
            rows.append(("op tests (tests/ops/test_msda_cuda.py)", ", ".join(f"{n} {w}" for n, w in m), name))
        elif name == "op_bench" or name.startswith("memory_"):
            table = [ln for ln in text.splitlines() if ln.startswith("|")]
            tables += [f"**{name}**", "", *table, ""]
            for ln in text.splitlines():
                if ln.startswith(("CUDA context", "vs upstream")):
                    rows.append((ln.split(":")[0], ln.split(":", 1)[1].strip(), name))
            if name.startswith("memory_"):
                for ln in table:
                    cells = [c.strip() for c in ln.strip().strip("|").split("|")]
                    if len(cells) != 11 or cells[0] in ("model", "---"):
                        continue  # the header, its rule, and the CUDA-context table that follows
                    rows.append(
                        (
                            f"memory {name[7:]} {cells[0]} batch {cells[2]} ({cells[3]}): reserved "
                            "predicted / measured",
                            f"{cells[7]} / {cells[8]} MiB ({cells[9]})",
                            name,
                        )
                    )
        elif name == "speed_decode_cuda":
            rates = [float(m) for m in re.findall(r"epoch=\d+ .*?images_per_s=([\d.]+)", text)]
            in_memory = [v for f, v, _ in rows if f.startswith("classification resnet50 224 px batch 256 bf16")]
            rate = rates[-1] if rates else None
            ratio = ""
            if rate and in_memory:
                ratio = f" ({rate / float(in_memory[0].split(' / ')[0].replace(',', '')):.3f} of the in-memory trainer)"
            rows.append(
                (
                    "classification resnet50 224 px batch 256 bf16 from JPEGs, decode_device cuda, 4 loader workers: "
                    "images/s (last epoch)",
                    f"{rate:,.1f}{ratio}" if rate else "?",
                    name,
                )
            )
        elif name.startswith("speed_"):
            for ln in text.splitlines():
                if ln.startswith("{"):
                    d = json.loads(ln)
                    ips = d["images_per_s"]
                    rows.append(
                        (
                            f"{name[6:]} {d['model']} {d['size']} px batch {d['batch']} {d['precision']}: "
                            "samples/s (images or clips) trainer / bare loop",
                            f"{ips['trainer']:,.1f} / {ips['minimal']:,.1f} "
                            f"(ratio {d['ratio_trainer_over_minimal']:.3f})",
                            name,
                        )
                    )
        elif name == "checkpoint":
            m = re.search(r"stall_steps=(-?[\d.]+)", text)
            rows.append(("periodic checkpoint cost (steps)", m.group(1) if m else "?", name))
    return rows, tables


def needed_datasets(steps: list[tuple[str, int, list[str]]], data: Path) -> list[str]:
    """The shared datasets that ``steps`` read from ``data`` and that are not there (a run that carries only some
    datasets, e.g. ``--only`` of the prepared GPU run's steps, needs only theirs)."""
    names = ("imagenette-subset", "rid-roofs", "video-clips")
    used = [d for d in names if any(str(data / d) in arg for _, _, argv in steps for arg in argv)]
    return [d for d in used if not (data / d).is_dir()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny sizes: a CPU check that the suite runs through")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="the shared datasets' folder")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu-suite", help="logs and gpu_suite.md")
    ap.add_argument("--only", help="comma-separated step names (default: all)")
    ap.add_argument(
        "--precisions",
        default="bf16-mixed,32",
        help="of speed_classification at full size (bf16-mixed: the rate speed_decode_cuda is compared with)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds: a step starts only while this many have not passed, under a limit cut to the time left "
        "(a lent GPU's minutes are few); 0 = no budget",
    )
    ap.add_argument(
        "--fresh-processes",
        action="store_true",
        help="with --small --device cpu: start each step in a fresh interpreter (default there: a fork of this "
        "process, which imported torch once)",
    )
    a = ap.parse_args()
    data, out = Path(a.data).resolve(), Path(a.out).resolve()
    steps = plan(a.device, a.small, data, out / "work", a.precisions)
    if a.only:
        keep = set(a.only.split(","))
        unknown = sorted(keep - {s[0] for s in steps})
        if unknown:
            print(f"error: --only: no step {', '.join(unknown)} on {a.device}", file=sys.stderr)
            return 2
        steps = [s for s in steps if s[0] in keep]
    missing = needed_datasets(steps, data)
    if missing:
        print(
            f"error: --data: {data} lacks {', '.join(missing)}; expected the shared datasets' folder", file=sys.stderr
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # The CPU check of the suite forks its steps from one process that imported torch once (about 6 s per step
    # less on 2 vCPUs); a GPU run starts each step in a fresh interpreter, as always.
    forked = a.small and a.device == "cpu" and not a.fresh_processes
    if forked:
        _preimport()
    results = []
    for name, limit, argv in steps:
        left = a.budget - (time.perf_counter() - t0) if a.budget else limit
        if left < 20:
            print(f"=== {name}: skipped, the --budget of {a.budget:.0f} s is spent", flush=True)
            results.append({"name": name, "rc": "skipped (budget)", "secs": 0.0, "text": "budget spent", "argv": argv})
            continue
        results.append(run_step(name, int(min(limit, left)), argv, out, forked))
    rows, tables = summarize(results)
    device = "CPU" if a.device == "cpu" else _gpu_name()
    head = (
        f"GPU suite on {device}, {datetime.date.today().isoformat()}, "
        f"`bash benchmarks/gpu_suite.sh {' '.join(sys.argv[1:])}` ({time.perf_counter() - t0:.0f} s)"
    )
    md = [head, "", "| figure | value | step (log) |", "| --- | --- | --- |"]
    md += [f"| {f} | {v} | {s} |" for f, v, s in rows]
    md += ["", *tables]
    (out / "gpu_suite.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["rc"] == 0 for r in results) else 1


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda (not available)"


if __name__ == "__main__":
    sys.exit(main())
