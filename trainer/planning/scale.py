"""``python -m trainer scale --plan PLAN.yaml``: run a scaling plan's phases in order on this machine, measure each
(time, samples/s, peak host memory, CPU use, loss, headline metric), check its criteria, stop at the first failure,
and write ``scale.json``/``scale.md``/``scale.png`` (:mod:`trainer.planning.scale_report`).

Plan file (YAML): ``base`` (a config file, relative to the plan file's folder, or absolute), optional ``overrides``
(config fields for every phase), ``host_memory_limit_pct`` (default ``max_host_memory_pct`` of every phase, 80),
``keep_checkpoints`` (default false: a phase's checkpoints are deleted once it is measured), and ``phases``: each
has ``name`` (letters, digits, ``.-_``; unique), ``overrides`` (cumulative: a phase starts from the previous
phase's), ``expect`` (text copied into the report), ``criteria`` (:data:`CRITERIA`) and optional ``device``
(shorthand for ``overrides.device``). A phase on ``cuda`` is skipped when this machine has no CUDA device.
Config values mean what they mean to ``train`` (paths relative to the working directory; ``data_dir`` is written
to the phase's config as an absolute path). ``--set FIELD=VALUE`` overrides a field in every phase, last.

Each phase runs as ``python -m trainer train --config OUT/<name>/phase.yaml`` (the merged config: the record of
what ran) with ``checkpoint_dir``/``log_dir`` under ``OUT/<name>/``; stdout/stderr go to ``stdout.log``/
``stderr.log`` there. Exit codes: 0 every phase that ran passed; 1 a phase failed (report still written); 2 bad
plan or option (one line); 130 interrupted by Ctrl-C (report of the phases so far written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from trainer.argtypes import field_values
from trainer.config import ALIASES, ConfigError, load_config, yaml_fields
from trainer.errors import EXIT_USAGE
from trainer.planning.scale_report import CRITERIA, GIB, host_memory

PLAN_KEYS = ("base", "overrides", "host_memory_limit_pct", "keep_checkpoints", "phases")
PHASE_KEYS = ("name", "overrides", "expect", "criteria", "device")
OOM_SIGNS = re.compile(r"out of memory|MemoryError|can't allocate memory", re.IGNORECASE)


@dataclass
class Phase:
    """One phase: its own ``overrides``, the merged ``config`` overrides it runs with, ``expect``, ``criteria``."""

    name: str
    overrides: dict
    config: dict
    task: str
    expect: str = ""
    criteria: dict = field(default_factory=dict)


@dataclass
class Plan:
    """A validated plan (:func:`load_plan`); ``base`` is the resolved base config path."""

    path: Path
    base: Path
    host_memory_limit_pct: float
    keep_checkpoints: bool
    phases: list


def _mapping(value: Any, where: str, fail) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(where, f"expected a mapping, got {type(value).__name__} {value!r}")
    return {ALIASES.get(str(k), str(k)): v for k, v in value.items()}


def _number(value: Any, where: str, fail) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise fail(where, f"got {value!r}; expected a number > 0")
    return float(value)


def _bool(value: Any, where: str, fail) -> bool:
    if not isinstance(value, bool):
        raise fail(where, f"got {value!r}; expected true or false")
    return value


def _criteria(raw: Any, where: str, fail, default_pct: float) -> dict:
    out = {"max_host_memory_pct": default_pct}
    for key, value in _mapping(raw, where, fail).items():
        if key not in CRITERIA:
            raise fail(where, f"unknown criterion {key!r}; known: {', '.join(CRITERIA)}")
        out[key] = (_bool if CRITERIA[key][0] is bool else _number)(value, f"{where}.{key}", fail)
    return out


def load_plan(path: str | Path, cli_overrides: Optional[dict] = None) -> Plan:
    """Read and validate plan file ``path``; every phase's merged config is validated with ``load_config`` so a
    typo fails before anything runs. ``cli_overrides`` (field -> value) win over the plan in every phase.

    Raises:
        ConfigError: one line ``plan PATH: FIELD: problem`` (unreadable or non-mapping YAML, unknown key, missing
            ``base`` or ``phases``, bad criterion, duplicate or bad phase name, or a config error of a phase).
    """
    p = Path(path)

    def fail(where: str, why: str) -> ConfigError:
        return ConfigError(f"plan {p}: {where}: {why}")

    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"plan {p}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"plan {p}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"plan {p}: expected a mapping with {', '.join(PLAN_KEYS)}, got {type(raw).__name__}")
    for key in raw:
        if key not in PLAN_KEYS:
            raise fail(str(key), f"unknown key; known: {', '.join(PLAN_KEYS)}")
    if not raw.get("base"):
        raise fail("base", "missing; name the config file the phases start from (relative to the plan's folder)")
    base = p.parent / str(raw["base"])
    if not base.is_file():
        raise fail("base", f"{base} is not a file (base is relative to the plan file's folder)")
    try:
        yaml_fields(base)
    except ConfigError as e:
        raise fail("base", str(e)) from None
    pct = _number(raw.get("host_memory_limit_pct", 80), "host_memory_limit_pct", fail)
    keep = _bool(raw.get("keep_checkpoints", False), "keep_checkpoints", fail)
    common = _mapping(raw.get("overrides"), "overrides", fail)
    cli = {ALIASES.get(k, k): v for k, v in (cli_overrides or {}).items()}
    _validate(base, {**common, **cli}, "overrides" + (" and --set" if cli else ""), fail)
    if not isinstance(raw.get("phases"), list) or not raw["phases"]:
        raise fail("phases", "missing or empty; expected a list of phases (name, overrides, expect, criteria)")
    phases, cumulative = [], {}
    for i, ph in enumerate(raw["phases"]):
        where = f"phases[{i}]"
        if not isinstance(ph, dict):
            raise fail(where, f"expected a mapping with {', '.join(PHASE_KEYS)}, got {ph!r}")
        for key in ph:
            if key not in PHASE_KEYS:
                raise fail(f"{where}.{key}", f"unknown key; known: {', '.join(PHASE_KEYS)}")
        name = str(ph.get("name") or "")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,15}", name) or any(q.name == name for q in phases):
            raise fail(
                f"{where}.name",
                f"got {name!r}; expected a unique name of 1-16 lower-case letters, digits or '-' (it also names "
                "SageMaker jobs and Step Functions states)",
            )
        own = _mapping(ph.get("overrides"), f"{where}.overrides", fail)
        if ph.get("device") is not None:
            own["device"] = str(ph["device"])
        cumulative = {**cumulative, **own}
        merged = {**common, **cumulative, **cli}
        cfg = _validate(base, merged, f"{where} ({name}).overrides", fail)
        crit = _criteria(ph.get("criteria"), f"{where}.criteria", fail, pct)
        phases.append(Phase(name, own, merged, cfg.task, str(ph.get("expect") or "").strip(), crit))
    return Plan(p, base, pct, keep, phases)


def _validate(base: Path, overrides: dict, where: str, fail):
    try:
        return load_config(base, overrides)
    except ConfigError as e:
        raise fail(where, str(e).replace("(command line)", "(plan overrides)")) from None


def _tree_memory(proc) -> tuple[int, int]:
    """(summed RSS, summed PSS) in bytes of ``proc`` (psutil.Process) and all its descendants; 0 when gone."""
    import psutil

    rss = pss = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for q in procs:
        try:
            info = q.memory_full_info()
            rss, pss = rss + info.rss, pss + getattr(info, "pss", 0)
        except psutil.Error:
            continue
    return rss, pss


def run_phase(phase: Phase, plan: Plan, out_dir: Path, interval_s: float = 0.2) -> dict:
    """Run ``phase`` as a ``train`` subprocess in ``out_dir/<name>/`` and return what was measured: ``wall_s``,
    ``cpu_s`` (user + system seconds of the tree), ``peak_rss_bytes`` / ``peak_pss_bytes`` (summed, sampled every
    ``interval_s`` seconds over the child and its loader workers), ``peak_system_memory_pct`` (whole host),
    ``returncode``, ``last_stderr``, ``oom_sign``, ``train_samples`` and the epoch rows of ``metrics.jsonl``."""
    import psutil

    d = out_dir / phase.name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    fields = {**yaml_fields(plan.base), **phase.config}
    fields.update(checkpoint_dir=str(d / "checkpoints"), log_dir=str(d / "logs"))
    if fields.get("data_dir"):
        fields["data_dir"] = str(Path(str(fields["data_dir"])).expanduser().resolve())
    header = f"# scale phase {phase.name} of {plan.path}: {plan.base} + the plan's overrides (exactly what ran)\n"
    (d / "phase.yaml").write_text(header + yaml.safe_dump(fields, sort_keys=False))
    cmd = [sys.executable, "-m", "trainer", "train", "--config", str(d / "phase.yaml")]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_rss = peak_pss = peak_sys = 0
    t0 = time.perf_counter()
    with open(d / "stdout.log", "w") as out, open(d / "stderr.log", "w") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        proc = psutil.Process(child.pid)
        try:
            while child.poll() is None:
                rss, pss = _tree_memory(proc)
                peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
                peak_sys = max(peak_sys, psutil.virtual_memory().percent)
                time.sleep(interval_s)
        except KeyboardInterrupt:
            _stop(child)
            raise
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    stdout, stderr = (d / "stdout.log").read_text(errors="replace"), (d / "stderr.log").read_text(errors="replace")
    if not plan.keep_checkpoints:
        shutil.rmtree(d / "checkpoints", ignore_errors=True)
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    oom = child.returncode == -9 or bool(OOM_SIGNS.search(stderr))
    return {
        "returncode": child.returncode,
        "last_stderr": lines[-1] if lines else "",
        "oom_sign": oom,
        "wall_s": wall,
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "peak_rss_bytes": peak_rss,
        "peak_pss_bytes": peak_pss,
        "peak_system_memory_pct": peak_sys,
        "train_samples": sum(int(n) for n in re.findall(r": (\d+) train and \d+ val pairs", stdout)) or None,
        "epochs": epoch_rows(d / "logs" / "metrics.jsonl"),
        "dir": str(d),
    }


def _stop(child: subprocess.Popen) -> None:
    """After Ctrl-C (which reaches the child too): wait up to 15 s for it to stop, then SIGTERM, then SIGKILL."""
    for send in (lambda: None, child.terminate, child.kill):
        send()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=15)
            return


def epoch_rows(path: Path) -> list:
    """The ``kind == "epoch"`` rows of a run's ``metrics.jsonl`` (dicts, in file order); lines cut by a kill are
    skipped; [] when the file does not exist."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return [r for r in rows if isinstance(r, dict) and r.get("kind") == "epoch"]


def add_scale_command(sub) -> None:
    """Register ``scale`` on the ``trainer`` sub-parsers."""
    p = sub.add_parser(
        "scale",
        help="run a scaling plan's phases in order and report measured vs expected",
        description="Run PLAN's phases (each a train subprocess), check their criteria, stop at the first failure; "
        "writes scale.json/.md/.png. Plan format: docs/segmentation.md and trainer/planning/scale.py.",
    )
    p.add_argument("--plan", required=True, help="plan YAML (base, overrides, host_memory_limit_pct, phases)")
    p.add_argument("--out-dir", default="runs/scale", help="phase folders and report (default: %(default)s)")
    p.add_argument("--host-memory-gib", type=float, help="host memory (GiB) for the %% criteria; default: this host's")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="config field for every phase")


def run_scale_command(args: argparse.Namespace) -> int:
    """Run ``scale`` from parsed arguments; returns the exit code (0 pass, 1 a phase failed, 2 bad input, 130)."""
    from trainer.planning import scale_report as report

    try:
        try:
            cli = field_values(args.set, "scale --set")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if args.host_memory_gib is not None and not args.host_memory_gib > 0:
            raise ConfigError(f"scale --host-memory-gib: got {args.host_memory_gib}; must be > 0")
        plan = load_plan(args.plan, cli)
        out_dir = Path(args.out_dir)
        report.check_out_dir(out_dir, [ph.name for ph in plan.phases])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    total, source = host_memory(args.host_memory_gib)
    memory = f" --host-memory-gib {args.host_memory_gib:g}" if args.host_memory_gib is not None else ""
    command = f"python -m trainer scale --plan {args.plan} --out-dir {args.out_dir}{memory}"
    command += "".join(f" --set {s}" for s in args.set)
    result = report.new_result(plan, total, source, command)
    print(f"scale: {len(plan.phases)} phase(s) of {plan.path}; host memory {total / GIB:.1f} GiB ({source})")
    code = report.run_phases(plan, out_dir, result, run_phase)
    for kind, path in report.write(result, out_dir).items():
        print(f"scale: {kind}: {path}")
    return code
