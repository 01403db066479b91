"""The prepared GPU run (DINO's real-loop throughput, the GPU decode, the checkpoint stall and the FFCV loader in
one device call): which steps of ``gpu_dino.sh`` and ``gpu_suite.py`` it runs, and its summary table.

``benchmarks/gpu_prepared_run.sh`` runs the steps (``--steps dino-skip`` / ``--steps suite`` print its lists) and
then ``--summary OUT`` writes ``OUT/prepared_run.md``: each figure beside its goal, met or not:

1. DINO-4scale R50, batch 2, canvases + ``dn_max_boxes`` 100 (``gpu_dino.sh``): the real loop's images/s over
   the epoch and over its second half (from the cumulative step log: (2b - 2a) / (t_b - t_a) images between the
   step lines a and b), GPU busy % over the epoch (``gpu_busy.py``), and the second half's ms/step over the
   synthetic step's (``dino_step.py``, eager or graphed as the run): eager, ``--matcher batched``,
   ``--cuda-graphs``, both. Goal >= 25 images/s, >= 70 % busy, <= 1.15x the synthetic step.
2. ``--decode-device cuda`` (``speed_decode_cuda``) over the in-memory trainer (``speed_classification``):
   goal >= 0.9.
3. The periodic checkpoint's cost in steps, ResNet-50 + EMA batch 256 bf16, 39 steps (``checkpoint``): <= 1.
4. Seed 003's FFCV loader (``speed_ffcv``): the trainer over the bare loop, both reading the trainer's FFCV
   loader: >= 0.98 (the goal for the trainer against the bare loop, as in ``gpu_suite.py``).

    python benchmarks/gpu_prepared_run.py --steps suite
    python benchmarks/gpu_prepared_run.py --summary /tmp/gpu-prepared-run
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# gpu_dino.sh steps this run takes: the op's build (only when the carried build does not load), the synthetic
# step eager and graphed, the real loop's four rows, their CUDA tests.
DINO_STEPS = (
    "build",
    "dino_step_static",
    "dino_step_graphs",
    "dino_train_static",
    "dino_train_static_batched_matcher",
    "dino_train_static_graphs",
    "dino_train_static_graphs_batched_matcher",
    "matcher_tests",
    "graphs_tests",
)
# gpu_suite.py steps, in this order: the in-memory rate first (the decode ratio's denominator), FFCV last.
SUITE_STEPS = (
    "speed_classification",
    "checkpoint",
    "jpeg_copies",
    "speed_decode_cuda",
    "ffcv_write",
    "speed_ffcv",
)
# Real-loop runs: (gpu_dino.sh step, what it sets, the synthetic step it is compared with).
DINO_RUNS = (
    ("dino_train_static", "eager (the configs today)", "dino_step_static"),
    ("dino_train_static_batched_matcher", "`--matcher batched`", "dino_step_static"),
    ("dino_train_static_graphs", "`--cuda-graphs`", "dino_step_graphs"),
    ("dino_train_static_graphs_batched_matcher", "`--cuda-graphs --matcher batched`", "dino_step_graphs"),
)
GOAL_IMAGES_PER_S, GOAL_BUSY, GOAL_OVER_SYNTHETIC = 25.0, 70.0, 1.15
GOAL_DECODE, GOAL_STALL, GOAL_FFCV = 0.9, 1.0, 0.98


def dino_steps_in_script(script: Path = HERE / "gpu_dino.sh") -> list[str]:
    """Every step name ``gpu_dino.sh`` can run (its ``step NAME`` and ``train NAME`` lines)."""
    names = re.findall(r"^\s*(?:step|train)\s+([a-z0-9_]+)\s", script.read_text(), re.M)
    return list(dict.fromkeys(names))


def dino_skip(script: Path = HERE / "gpu_dino.sh") -> list[str]:
    """``SKIP`` for ``gpu_dino.sh``: its steps that this run does not take."""
    return [n for n in dino_steps_in_script(script) if n not in DINO_STEPS]


def _keys(line: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+)=(-?[0-9.]+(?:[eE][+-]?\d+)?)\b", line)}


def loop_rates(log: str, batch: int = 2) -> tuple[float | None, float | None]:
    """(images/s over the epoch, images/s over the second half) of a trainer log: the epoch line's
    ``images_per_s``, and (batch * (b - a)) / (t_b - t_a) between the step line a at or past half the last step
    and the last step line b, where t_n = batch * n / images_per_s_n (the step lines' rate is cumulative)."""
    epoch = [_keys(ln) for ln in log.splitlines() if ln.startswith("epoch=") and "images_per_s=" in ln]
    steps = [_keys(ln) for ln in log.splitlines() if ln.startswith("step=") and "images_per_s=" in ln]
    steps = [s for s in steps if s["images_per_s"] > 0]
    half = None
    if len(steps) >= 2:
        b = steps[-1]
        a = next(s for s in steps if s["step"] >= b["step"] / 2)
        if a is not b:
            t = [batch * s["step"] / s["images_per_s"] for s in (a, b)]
            half = batch * (b["step"] - a["step"]) / (t[1] - t[0]) if t[1] > t[0] else None
    return (epoch[-1]["images_per_s"] if epoch else None), half


def synthetic_ms(log: str, batch: int = 2) -> float | None:
    """ms per step of ``dino_step.py --time-batches`` at ``batch`` (its ``timed: batch=B ms_per_step=X`` line)."""
    for ln in log.splitlines():
        if ln.startswith("timed: batch="):
            k = _keys(ln)
            if k.get("batch") == batch:
                return k["ms_per_step"]
    return None


def busy_pct(text: str) -> float | None:
    """The epoch window's busy % from ``gpu_busy.py``'s line (``busy NN.N % over the epoch ...``)."""
    m = re.search(r"busy ([0-9.]+) % over the epoch", text)
    return float(m.group(1)) if m else None


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _met(ok: bool | None) -> str:
    return "—" if ok is None else ("**yes**" if ok else "no")


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "not measured" if v is None else format(v, spec)


def suite_rows(md: str) -> dict[str, list[tuple[str, str]]]:
    """{step: [(figure, value)]} from ``gpu_suite.md``'s summary table."""
    rows: dict[str, list[tuple[str, str]]] = {}
    for ln in md.splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if ln.startswith("|") and len(cells) == 3 and cells[0] not in ("figure", "---"):
            rows.setdefault(cells[2], []).append((cells[0], cells[1]))
    return rows


def _number(value: str, pattern: str) -> float | None:
    m = re.search(pattern, value)
    return float(m.group(1).replace(",", "")) if m else None


def summary(out: Path) -> list[str]:
    """Markdown lines of the run's table from ``out/dino`` (gpu_dino.sh's logs) and ``out/suite/gpu_suite.md``."""
    dino = out / "dino"
    lines = [
        "| item | figure | value | goal | met? | log |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run, what, synth in DINO_RUNS:
        log = _read(dino / f"{run}.log")
        epoch, half = loop_rates(log)
        busy = busy_pct(_read(dino / f"{run}.busy"))
        ms = synthetic_ms(_read(dino / f"{synth}.log"))
        over = (2000.0 / half) / ms if half and ms else None
        ok = None
        if epoch is not None and busy is not None:
            ok = epoch >= GOAL_IMAGES_PER_S and busy >= GOAL_BUSY and (over is None or over <= GOAL_OVER_SYNTHETIC)
        value = (
            f"{_fmt(epoch, '.2f')} images/s over the epoch, {_fmt(half, '.2f')} over its second half; "
            f"busy {_fmt(busy)} %; second half {_fmt(over, '.2f')} x the synthetic step ({_fmt(ms)} ms, {synth})"
            if log
            else "not run"
        )
        goal = f">= {GOAL_IMAGES_PER_S:g} images/s, >= {GOAL_BUSY:g} % busy, <= {GOAL_OVER_SYNTHETIC}x synthetic"
        lines.append(f"| 1 DINO | real loop batch 2, {what} | {value} | {goal} | {_met(ok)} | {run} |")
    for name in ("matcher_tests", "graphs_tests"):
        found = re.findall(r"(\d+) (passed|failed|skipped|error)", _read(dino / f"{name}.log"))
        value = ", ".join(f"{n} {w}" for n, w in found) or "not run"
        ok = None if not found else not any(w in ("failed", "error") for _, w in found)
        lines.append(f"| 1 DINO | CUDA tests | {value} | pass | {_met(ok)} | {name} |")
    rows = suite_rows(_read(out / "suite" / "gpu_suite.md"))
    checks = (
        ("2 decode", "speed_decode_cuda", r"\(([0-9.]+) of the in-memory", f">= {GOAL_DECODE}x in-memory", GOAL_DECODE),
        ("3 checkpoint", "checkpoint", r"^(-?[0-9.]+)$", f"<= {GOAL_STALL:g} step", -GOAL_STALL),
        ("4 FFCV", "speed_ffcv", r"ratio ([0-9.]+)", f">= {GOAL_FFCV} (trainer / bare loop)", GOAL_FFCV),
    )
    for item, step, pattern, goal, bound in checks:
        got = rows.get(step) or [(step, "not run")]
        for figure, value in got:
            v = _number(value, pattern)
            ok = None if v is None else (v >= bound if bound > 0 else v <= -bound)
            lines.append(f"| {item} | {figure} | {value} | {goal} | {_met(ok)} | {step} |")
    for figure, value in rows.get("speed_classification", []):
        lines.append(f"| 2 decode | {figure} (the in-memory rate) | {value} | — | — | speed_classification |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--steps", choices=("dino-skip", "suite"), help="print a comma-separated step list")
    g.add_argument("--summary", help="OUT folder of gpu_prepared_run.sh: write OUT/prepared_run.md and print it")
    ap.add_argument("--head", default="", help="a first line for prepared_run.md (machine, commit, command)")
    a = ap.parse_args(argv)
    if a.steps:
        print(",".join(dino_skip() if a.steps == "dino-skip" else SUITE_STEPS))
        return 0
    out = Path(a.summary)
    if not out.is_dir():
        print(f"error: --summary: {out} is not a folder", file=sys.stderr)
        return 2
    md = ([a.head, ""] if a.head else []) + summary(out)
    (out / "prepared_run.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
