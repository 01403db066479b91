"""Criteria, verdicts and report of ``python -m trainer scale`` (:mod:`trainer.planning.scale`).

Every phase is judged on its exit status (non-zero = failed) and its ``criteria`` (:data:`CRITERIA`); a
criterion that cannot apply (a ratio on the first phase that ran, ``loss_falling`` on a one-epoch first phase) is
"n/a" and does not fail. "Previous phase" is the last phase that ran (skipped phases do not count).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from trainer.config import ConfigError
from trainer.errors import EXIT_ABORTED, EXIT_OK

GIB = 1024**3
#: Criterion -> (value type, what it checks).
CRITERIA = {
    "no_oom": (bool, "no out-of-memory sign (stderr, SIGKILL) and peak host memory below the host's"),
    "loss_finite": (bool, "every epoch's train_loss is finite"),
    "loss_falling": (bool, "last epoch's train_loss < first epoch's (one epoch: < the previous phase's final)"),
    "max_host_memory_pct": (float, "peak host memory (PSS) of the process tree <= this % of host memory"),
    "min_samples_per_s_ratio": (float, "samples/s >= this x the previous phase's"),
    "min_cpu_util_ratio": (float, "CPU utilization >= this x the previous phase's"),
}


def host_memory(gib: Optional[float] = None) -> tuple[int, str]:
    """Host memory in bytes and its source: ``gib`` (``--host-memory-gib``), else the smaller of
    ``psutil.virtual_memory().total`` and a cgroup v2 ``memory.max`` limit."""
    import psutil

    if gib is not None:
        return int(gib * GIB), f"--host-memory-gib {gib:g}"
    total, cgroup = psutil.virtual_memory().total, Path("/sys/fs/cgroup/memory.max")
    limit = cgroup.read_text().strip() if cgroup.is_file() else ""
    if limit.isdigit() and int(limit) < total:
        return int(limit), "cgroup memory.max"
    return total, "psutil.virtual_memory().total"


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((x.split(":", 1)[1].strip() for x in lines if x.lower().startswith("model name")), "unknown CPU")


def check_out_dir(out_dir: Path, names: list) -> None:
    """Create ``out_dir``. Raises ConfigError when it cannot be, or when ``out_dir/<name>`` holds files that
    ``scale`` did not write (no ``phase.yaml``): phase folders are emptied before their phase runs."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out-dir {out_dir}: cannot create it ({e.strerror or e})") from None
    for name in names:
        d = out_dir / name
        if d.exists() and (not d.is_dir() or (any(d.iterdir()) and not (d / "phase.yaml").is_file())):
            raise ConfigError(f"--out-dir {out_dir}: {d} exists and was not written by scale; choose another --out-dir")


def new_result(plan, host_bytes: int, source: str, command: str) -> dict:
    """The ``scale.json`` skeleton: plan, command, date, host (CPU model, CPUs, memory in bytes and its source)."""
    host = dict(
        cpu_model=_cpu_model(), cpus=len(os.sched_getaffinity(0)), memory_bytes=host_bytes, memory_source=source
    )
    out = dict(plan=str(plan.path), base=str(plan.base), command=command, date=time.strftime("%Y-%m-%d %H:%M %Z"))
    return {**out, "host": {**host, "cuda": None}, "host_memory_limit_pct": plan.host_memory_limit_pct, "phases": []}


def measure(raw: dict, task: str, host_bytes: int, cpus: int) -> dict:
    """Derived figures of one phase from :func:`trainer.planning.scale.run_phase`'s ``raw``: ``samples_per_s``
    (last epoch's images_per_s), ``epoch_time_s`` (last epoch, s), ``train_time_s`` (all epochs, s), ``loss_first`` /
    ``loss_last``, ``headline`` (the task's first ``val_*`` metric in catalog.metrics) and its value,
    ``peak_host_bytes`` (summed PSS of the tree; summed RSS if PSS is unreadable) and ``peak_host_pct`` (% of
    ``host_bytes``), ``cpu_util_pct`` (CPU seconds / wall seconds / ``cpus`` x 100), ``load_avg_1m`` (host load
    average at the phase's end, this run included: other work on the host slows the phase)."""
    from catalog.metrics import TASK_METRICS

    rows = raw["epochs"]
    last = rows[-1] if rows else {}
    headline = next((k for k in TASK_METRICS.get(task, ()) if k.startswith("val_")), None)
    losses = [float(r["train_loss"]) for r in rows if "train_loss" in r]
    peak = raw["peak_pss_bytes"] or raw["peak_rss_bytes"]
    return {
        **{k: v for k, v in raw.items() if k != "epochs"},
        "epoch_rows": rows,
        "samples_per_s": last.get("images_per_s"),
        "epoch_time_s": last.get("epoch_time_s"),
        "train_time_s": sum(float(r.get("epoch_time_s", 0.0)) for r in rows) if rows else None,
        "losses": losses,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "headline": headline,
        "headline_value": last.get(headline) if headline else None,
        "peak_host_bytes": peak,
        "peak_host_pct": 100.0 * peak / host_bytes,
        "cpu_util_pct": 100.0 * raw["cpu_s"] / max(raw["wall_s"], 1e-9) / max(cpus, 1),
        "load_avg_1m": os.getloadavg()[0],
        "device_memory": "not measured (metrics.jsonl has no device-memory field)",
    }


def _check(name: str, required: str, measured: str, passed: Optional[bool]) -> dict:
    return {"criterion": name, "required": required, "measured": measured, "passed": passed}


def _ratio(name: str, key: str, need: float, m: dict, prev: Optional[dict]) -> dict:
    cur, before = m.get(key), (prev or {}).get(key)
    if not cur or not before:
        return _check(name, f">= {need:g}x", "n/a (no previous phase)", None)
    return _check(name, f">= {need:g}x", f"{cur / before:.2f}x ({cur:.3g} vs {before:.3g})", cur / before >= need)


def _loss_falling(losses: list, prev: Optional[dict]) -> dict:
    if len(losses) > 1:
        return _check("loss_falling", "last < first", f"{losses[0]:.4f} -> {losses[-1]:.4f}", losses[-1] < losses[0])
    if losses and prev and prev.get("loss_last") is not None:
        got = f"{losses[0]:.4f} vs {prev['loss_last']:.4f}"
        return _check("loss_falling", "< previous phase's final", got, losses[0] < prev["loss_last"])
    return _check("loss_falling", "last < first", "n/a (one epoch, no previous phase)" if losses else "no epoch rows",
                  None if losses else False)  # fmt: skip


def evaluate(criteria: dict, m: dict, prev: Optional[dict], host_bytes: int) -> list:
    """Checks of one phase: ``[{"criterion", "required", "measured", "passed"}]`` with ``passed`` True, False, or
    None (n/a). The first is always ``exit_status`` (0 required); then each criterion of ``criteria`` in order."""
    rc, losses, pct = m["returncode"], m["losses"], m["peak_host_pct"]
    checks = [_check("exit_status", "0", f"{rc}" + (f" ({m['last_stderr']})" if rc else ""), rc == 0)]
    for name, need in criteria.items():
        if name == "no_oom" and need:
            got = f"peak {m['peak_host_bytes'] / GIB:.2f} GiB of {host_bytes / GIB:.2f} GiB"
            got = "out-of-memory sign in stderr or SIGKILL" if m["oom_sign"] else got
            checks.append(_check(name, "true", got, not m["oom_sign"] and m["peak_host_bytes"] < host_bytes))
        elif name == "loss_finite" and need:
            got = ", ".join(f"{x:.4g}" for x in losses) or "no epoch rows"
            checks.append(_check(name, "true", got, bool(losses) and all(math.isfinite(x) for x in losses)))
        elif name == "loss_falling" and need:
            checks.append(_loss_falling(losses, prev))
        elif name == "max_host_memory_pct":
            checks.append(_check(name, f"<= {need:g} %", f"{pct:.2f} %", pct <= need if m["peak_host_bytes"] else None))
        elif name in ("min_samples_per_s_ratio", "min_cpu_util_ratio"):
            key = "samples_per_s" if name == "min_samples_per_s_ratio" else "cpu_util_pct"
            checks.append(_ratio(name, key, need, m, prev))
    return checks


def _fmt(x: Optional[float], spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def summary(m: dict, prev: Optional[dict] = None, sep: str = "; ") -> str:
    """A phase's measurements, parts joined by ``sep``: train (summed epoch_time_s) and wall seconds, samples/s,
    CPU % and host load, peak host memory (PSS: GiB, % of host; RSS sum), loss first -> last, headline metric;
    (xN) = vs ``prev``."""

    def vs(key: str) -> str:
        a, b = m.get(key), (prev or {}).get(key)
        return f" (x{a / b:.2f})" if a and b else ""

    n = f", {m['train_samples']} train samples" if m["train_samples"] else ""
    loss = " -> ".join(f"{x:.4f}" for x in m["losses"][:1] + m["losses"][1:][-1:]) or "-"
    head = f", {m['headline']} {_fmt(m['headline_value'], '.2f')}" if m["headline"] else ""
    return sep.join(
        [
            f"train {_fmt(m['train_time_s'], '.1f')} s{vs('train_time_s')}, wall {m['wall_s']:.1f} s{n}",
            f"{_fmt(m['samples_per_s'])} samples/s{vs('samples_per_s')}, CPU {m['cpu_util_pct']:.0f} %, "
            f"load {m['load_avg_1m']:.1f}",
            f"peak host {m['peak_host_bytes'] / GIB:.2f} GiB = {m['peak_host_pct']:.1f} % "
            f"(RSS sum {m['peak_rss_bytes'] / GIB:.2f} GiB)",
            f"loss {loss}{head}",
        ]
    )


def run_phases(plan, out_dir: Path, result: dict, run_phase: Callable) -> int:
    """Run ``plan``'s phases in order with ``run_phase(phase, plan, out_dir)``, filling ``result["phases"]``;
    ``cuda`` phases are skipped without CUDA; stop at the first failed phase. Prints one line per phase. Returns
    0 (every phase that ran passed), 1 (a phase failed) or 130 (Ctrl-C; the phase in flight is "interrupted")."""
    prev, stopped, host = None, None, result["host"]
    for i, ph in enumerate(plan.phases):
        rec = {"name": ph.name, "overrides": ph.overrides, "config_overrides": ph.config, "expect": ph.expect,
               "criteria": ph.criteria, "task": ph.task}  # fmt: skip
        result["phases"].append(rec)
        tag = f"scale: [{i + 1}/{len(plan.phases)}] {ph.name}"
        if stopped:
            rec.update(status="not run", reason=f"stopped after {stopped} failed")
            continue
        if str(ph.config.get("device", "")).startswith("cuda"):
            if host["cuda"] is None:
                import torch

                host["cuda"] = bool(torch.cuda.is_available())
            if not host["cuda"]:
                rec.update(status="skipped", reason="needs CUDA; torch.cuda.is_available() is False here")
                print(f"{tag}: skipped: {rec['reason']}", flush=True)
                continue
        print(f"{tag}: running {' '.join(f'{k}={v}' for k, v in ph.overrides.items()) or '(base)'}", flush=True)
        try:
            raw = run_phase(ph, plan, out_dir)
        except KeyboardInterrupt:
            rec.update(status="interrupted", reason="Ctrl-C")
            result["result"] = "interrupted"
            print(f"{tag}: interrupted", file=sys.stderr, flush=True)
            return EXIT_ABORTED
        m = measure(raw, ph.task, host["memory_bytes"], host["cpus"])
        checks = evaluate(ph.criteria, m, prev, host["memory_bytes"])
        failed = [c for c in checks if c["passed"] is False]
        reason = "; ".join(f"{c['criterion']}: measured {c['measured']}, required {c['required']}" for c in failed)
        rec.update(measured=m, checks=checks, status="FAIL" if failed else "pass", reason=reason)
        print(f"{tag}: {'FAIL: ' + reason if failed else 'pass'}; {summary(m, prev)}", flush=True)
        if failed:
            stopped = ph.name
        else:
            prev = m
    result["result"] = f"FAIL at {stopped}" if stopped else "pass"
    return 1 if stopped else EXIT_OK


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(result: dict) -> str:
    """``scale.md``: header (date, command, host), the phase table (phase | overrides | expected | measured |
    verdict) and every check (criterion, required, measured, result)."""
    h = result["host"]
    lines = [
        f"# Scaling plan {result['plan']}: {result['result']}",
        "",
        f"- {result['date']}: `{result['command']}`",
        f"- host: {h['cpu_model']}, {h['cpus']} CPUs, {h['memory_bytes'] / GIB:.1f} GiB memory ({h['memory_source']}), "
        f"CUDA {({None: 'not checked', True: 'yes', False: 'no'})[h['cuda']]}; base config {result['base']}",
        "- overrides are each phase's own (cumulative: a phase keeps the earlier phases' overrides); (xN) = vs the "
        "previous phase that ran; train = summed epoch_time_s; device memory is not measured",
        "",
        "| phase | overrides | expected | measured | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    prev = None
    for r in result["phases"]:
        over = ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "(base)"
        measured = summary(r["measured"], prev, "<br>") if "measured" in r else "-"
        verdict = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        lines.append(f"| {r['name']} | {_cell(over)} | {_cell(r['expect']) or '-'} | {measured} | {_cell(verdict)} |")
        prev = r["measured"] if r["status"] == "pass" else prev
    lines += ["", "## Checks", "", "| phase | criterion | required | measured | result |", "|---|---|---|---|---|"]
    for r in result["phases"]:
        for c in r.get("checks", []):
            ok = {True: "pass", False: "FAIL", None: "n/a"}[c["passed"]]
            lines.append(f"| {r['name']} | {c['criterion']} | {_cell(c['required'])} | {_cell(c['measured'])} | {ok} |")
    return "\n".join(lines) + "\n"


def render_plot(result: dict, path: Path) -> Path:
    """Two panels per phase: samples/s, and peak host memory (PSS) in % of host memory with the plan's limit line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = result["phases"]
    names = [r["name"] + ("" if "measured" in r else f" ({r['status']})") for r in rs]
    sps = [(r.get("measured") or {}).get("samples_per_s") or 0.0 for r in rs]
    mem = [(r.get("measured") or {}).get("peak_host_pct") or 0.0 for r in rs]
    colour = ["tab:red" if r["status"] == "FAIL" else "tab:blue" for r in rs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(rs) + 4), 4.5))
    a.bar(names, sps, color=colour)
    a.set(ylabel="samples/s", title="training speed (last epoch)")
    b.bar(names, mem, color=colour)
    b.axhline(result["host_memory_limit_pct"], color="tab:orange", linestyle="--", label="host_memory_limit_pct")
    b.set(
        ylabel="% of host memory", title=f"peak host memory, PSS (host {result['host']['memory_bytes'] / GIB:.1f} GiB)"
    )
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)


def write(result: dict, out_dir: Path) -> dict:
    """Write ``scale.json``, ``scale.md`` and ``scale.png`` into ``out_dir``; returns {kind: path}."""
    paths = {"json": out_dir / "scale.json", "markdown": out_dir / "scale.md", "plot": out_dir / "scale.png"}
    strict = json.loads(json.dumps(result), parse_constant=str)  # NaN/Infinity -> "NaN"/"Infinity"
    paths["json"].write_text(json.dumps(strict, indent=2) + "\n")
    paths["markdown"].write_text(render_markdown(result))
    render_plot(result, paths["plot"])
    return paths
