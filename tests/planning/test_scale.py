"""scale: plan validation (one line, exit 2, nothing run), the criteria's definitions, seed 001's plan file, an
end-to-end run of its first CPU phases and its GPU phase on the shared RID tiles, and a stop at a failed criterion."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from bad_input_table import REPO, Case, run_case, trainer_cmd

from tests import forkserver
from trainer.config import load_config
from trainer.planning.scale import load_plan
from trainer.planning.scale_report import evaluate

SEED_PLAN = REPO / "configs" / "seed001_scaling.yaml"
BASE = REPO / "configs" / "seed001_roofs_cpu.yaml"
TINY = ["--set", "image_size=64", "--set", "encoder=resnet18", "--set", "num_workers=1"]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _plan(tmp: Path, phases: list, **top) -> Path:
    """Write a plan with ``base`` = seed 001's CPU config (absolute) into ``tmp/plan.yaml``."""
    path = tmp / "plan.yaml"
    path.write_text(yaml.safe_dump({"base": str(BASE), **top, "phases": phases}, sort_keys=False))
    return path


def _scale(plan: Path | str, tmp: Path, *extra: str) -> list[str]:
    return trainer_cmd("scale", "--plan", str(plan), "--out-dir", str(tmp / "out"), *extra)


def _bad_plan(text: str, *extra: str):
    def setup(tmp: Path) -> list[str]:
        (tmp / "plan.yaml").write_text(text.replace("BASE", str(BASE)))
        return _scale(tmp / "plan.yaml", tmp, *extra)

    return setup


def _nothing_ran(tmp: Path) -> None:
    assert not list((tmp / "out").glob("*/phase.yaml")), "a phase ran although the plan was refused"


PHASE = "phases: [{name: p1, overrides: {max_samples: 20}, criteria: {no_oom: true}}]\n"
GOOD = "base: BASE\n" + PHASE
BAD_PLANS = [  # (id, plan text with BASE for seed 001's CPU config, fragment of the one error line)
    ("unknown-criterion", "base: BASE\nphases: [{name: p1, criteria: {fast: true}}]\n", "phases[0].criteria: unknown "
     "criterion 'fast'; known: no_oom, loss_finite, loss_falling, max_host_memory_pct, min_samples_per_s_ratio"),
    ("missing-base", PHASE, "base: missing"),
    ("base-not-a-file", "base: nowhere.yaml\n" + PHASE, "nowhere.yaml is not a file"),
    ("not-a-config-field", "base: BASE\nphases: [{name: p1}, {name: p2, overrides: {max_sample: 5}}]\n",
     "phases[1] (p2).overrides: max_sample (plan overrides): unknown config field; did you mean max_samples"),
    ("bad-field-value", "base: BASE\nphases: [{name: p1, overrides: {batch_size: many}}]\n",
     "batch_size (plan overrides): got 'many'"),
    ("bad-yaml", "base: BASE\nphases: [{name: p1\n", "not valid YAML"),
    ("not-a-mapping", "- just\n- a list\n", "expected a mapping with base"),
    ("unknown-plan-key", "base: BASE\nphase: []\n", "phase: unknown key; known: base"),
    ("no-phases", "base: BASE\nphases: []\n", "phases: missing or empty"),
    ("duplicate-name", "base: BASE\nphases: [{name: p1}, {name: p1}]\n",
     "phases[1].name: got 'p1'; expected a unique name"),
    ("criterion-not-a-number", "base: BASE\nphases: [{name: p1, criteria: {max_host_memory_pct: high}}]\n",
     "phases[0].criteria.max_host_memory_pct: got 'high'; expected a number > 0"),
    ("unknown-phase-key", "base: BASE\nphases: [{name: p1, expected: faster}]\n", "phases[0].expected: unknown key"),
]  # fmt: skip


@pytest.mark.parametrize("case_id,text,message", BAD_PLANS, ids=[c[0] for c in BAD_PLANS])
def test_bad_plan_exits_2_with_one_line_naming_plan_and_field(tmp_path, case_id, text, message):
    proc = run_case(Case(case_id, _bad_plan(text), 2, message, _nothing_ran), tmp_path)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: plan {tmp_path / 'plan.yaml'}"), proc.stderr


BAD_OPTIONS = [
    Case("missing-plan-file", lambda t: _scale(t / "absent.yaml", t), 2, "absent.yaml: cannot read"),
    Case("set-without-value", _bad_plan(GOOD, "--set", "image_size"), 2, "expected FIELD=VALUE"),
    Case("set-unknown-field", _bad_plan(GOOD, "--set", "imagesize=64"), 2, "imagesize (plan overrides): unknown"),
    Case("host-memory-zero", _bad_plan(GOOD, "--host-memory-gib", "0"), 2, "--host-memory-gib: got 0.0; must be > 0"),
    Case("no-plan-flag", lambda t: trainer_cmd("scale"), 2, "the following arguments are required: --plan"),
]


@pytest.mark.parametrize("case", BAD_OPTIONS, ids=[c.id for c in BAD_OPTIONS])
def test_bad_options_exit_2(tmp_path, case):
    run_case(case, tmp_path)


def test_foreign_folder_in_out_dir_is_refused_before_anything_runs(tmp_path):
    def setup(tmp: Path) -> list[str]:
        (tmp / "out" / "p1").mkdir(parents=True)
        (tmp / "out" / "p1" / "notes.txt").write_text("mine")
        return _bad_plan(GOOD)(tmp)

    run_case(Case("foreign-folder", setup, 2, "p1 exists and was not written by scale"), tmp_path)
    assert (tmp_path / "out" / "p1" / "notes.txt").read_text() == "mine"


def test_seed_plan_validates_cumulatively_with_gpu_phases_last():
    plan = load_plan(SEED_PLAN)
    names = [p.name for p in plan.phases]
    assert names[:8] == [
        "p0-baseline",
        "p1-samples-20",
        "p1-samples-50",
        "p1-samples-100",
        "p2-batch-4",
        "p2-batch-8",
        "p2-batch-16",
        "p3-workers-4",
    ]
    by = {p.name: p for p in plan.phases}
    assert by["p3-workers-4"].config == {
        "data_dir": "../shared/data/rid-roofs",
        "max_samples": 100,
        "batch_size": 16,
        "num_workers": 4,
    }
    gpu = [p for p in plan.phases if p.config.get("device") == "cuda"]
    assert [p.name for p in gpu] == names[-3:] == ["p5-gpu", "p5-gpu-1024-amp", "p5-gpu-full"]
    assert (
        by["p5-gpu-1024-amp"].config["image_size"] == 1024 and by["p2-batch-16"].criteria["max_host_memory_pct"] == 80
    )
    assert all(p.criteria["max_host_memory_pct"] == plan.host_memory_limit_pct == 80 for p in plan.phases[:2])


def _m(losses, sps=10.0, cpu=50.0, rc=0, peak=1 << 30, oom=False):
    return {"returncode": rc, "last_stderr": "boom" if rc else "", "losses": losses, "oom_sign": oom,
            "loss_last": losses[-1] if losses else None, "samples_per_s": sps, "cpu_util_pct": cpu,
            "peak_host_bytes": peak, "peak_host_pct": 100.0 * peak / (16 << 30)}  # fmt: skip


def _verdicts(criteria, m, prev=None):
    return {c["criterion"]: c["passed"] for c in evaluate(criteria, m, prev, 16 << 30)}


def test_criteria_definitions():
    # loss_falling: several epochs -> last < first; one epoch -> below the previous phase's final; else n/a.
    assert _verdicts({"loss_falling": True}, _m([2.0, 1.5]))["loss_falling"] is True
    assert _verdicts({"loss_falling": True}, _m([2.0, 2.1]))["loss_falling"] is False
    assert _verdicts({"loss_falling": True}, _m([1.9]), _m([2.0]))["loss_falling"] is True
    assert _verdicts({"loss_falling": True}, _m([2.0]), _m([2.0]))["loss_falling"] is False
    assert _verdicts({"loss_falling": True}, _m([2.0]))["loss_falling"] is None
    assert _verdicts({"loss_falling": True}, _m([]))["loss_falling"] is False
    assert _verdicts({"loss_finite": True}, _m([2.0, float("nan")]))["loss_finite"] is False
    # ratios against the previous phase that ran; n/a for the first
    v = _verdicts({"min_samples_per_s_ratio": 1.0, "min_cpu_util_ratio": 1.0}, _m([1.0], 9.0, 60.0), _m([1.0]))
    assert v == {"exit_status": True, "min_samples_per_s_ratio": False, "min_cpu_util_ratio": True}
    assert _verdicts({"min_samples_per_s_ratio": 1.0}, _m([1.0]))["min_samples_per_s_ratio"] is None
    # memory: % of host memory; no_oom: an OOM sign or a peak at/over the host's memory
    assert _verdicts({"max_host_memory_pct": 80.0}, _m([1.0], peak=13 << 30))["max_host_memory_pct"] is False
    assert _verdicts({"max_host_memory_pct": 80.0}, _m([1.0], peak=12 << 30))["max_host_memory_pct"] is True
    assert _verdicts({"no_oom": True}, _m([1.0], rc=1, oom=True)) == {"exit_status": False, "no_oom": False}
    assert _verdicts({"no_oom": True}, _m([1.0], peak=16 << 30))["no_oom"] is False


def _run(argv: list[str], tmp: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO), **ENV}
    return forkserver.run(argv, cwd=tmp, env=env, timeout=300)


@pytest.mark.slow
def test_seed_plan_first_phases_and_gpu_phase_end_to_end(tmp_path, shared_data):
    import torch

    seed = yaml.safe_load(SEED_PLAN.read_text())
    phases = [p for p in seed["phases"] if p["name"] in ("p0-baseline", "p1-samples-20", "p5-gpu")]
    plan = _plan(tmp_path, phases, overrides={"data_dir": str(shared_data / "rid-roofs")})
    proc = _run(_scale(plan, tmp_path, *TINY), tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    d = tmp_path / "out"
    for name in ("scale.md", "scale.json", "scale.png"):
        assert (d / name).is_file() and (d / name).stat().st_size > 0, name
    assert (d / "scale.png").read_bytes()[:4] == b"\x89PNG"
    result = json.loads((d / "scale.json").read_text())
    rows = {r["name"]: r for r in result["phases"]}
    gpu = torch.cuda.is_available()
    assert [rows[n]["status"] for n in ("p0-baseline", "p1-samples-20")] == ["pass", "pass"]
    assert rows["p5-gpu"]["status"] == ("pass" if gpu else "skipped"), rows["p5-gpu"]
    for name in ("p0-baseline", "p1-samples-20"):
        m = rows[name]["measured"]
        assert m["samples_per_s"] > 0 and m["peak_rss_bytes"] > 0 and m["peak_host_bytes"] > 0 and m["wall_s"] > 0
        assert m["headline"] == "val_miou" and m["headline_value"] is not None and len(m["losses"]) == 1
        assert not (d / name / "checkpoints").exists()
    assert [rows[n]["measured"]["train_samples"] for n in ("p0-baseline", "p1-samples-20")] == [10, 20]
    cfg = load_config(d / "p1-samples-20" / "phase.yaml")
    assert (cfg.max_samples, cfg.image_size, cfg.encoder, cfg.log_dir) == (
        20,
        64,
        "resnet18",
        str(d / "p1-samples-20" / "logs"),
    )
    md = (d / "scale.md").read_text()
    assert "| phase | overrides | expected | measured | verdict |" in md and "~2x training time" in md
    assert ("skipped: needs CUDA" in md) != gpu
    lines = [x for x in proc.stdout.splitlines() if x.startswith("scale: [") and ("pass" in x or "skipped" in x)]
    assert len(lines) == 3 and f"scale: markdown: {d / 'scale.md'}" in proc.stdout


@pytest.mark.slow
def test_failed_criterion_stops_the_run_with_exit_1_and_names_it(tmp_path, shared_data):
    phases = [
        {"name": "tight", "expect": "fits", "criteria": {"max_host_memory_pct": 0.001}},
        {"name": "next", "overrides": {"max_samples": 20}},
    ]
    plan = _plan(tmp_path, phases, overrides={"data_dir": str(shared_data / "rid-roofs"), "max_samples": 4})
    proc = _run(_scale(plan, tmp_path, *TINY), tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, (proc.stdout + proc.stderr)[-4000:]
    assert "tight: FAIL: max_host_memory_pct: measured" in proc.stdout and "required <= 0.001 %" in proc.stdout
    result = json.loads((tmp_path / "out" / "scale.json").read_text())
    assert result["result"] == "FAIL at tight"
    assert [(r["name"], r["status"]) for r in result["phases"]] == [("tight", "FAIL"), ("next", "not run")]
    assert not (tmp_path / "out" / "next").exists()
    md = (tmp_path / "out" / "scale.md").read_text()
    assert "FAIL: max_host_memory_pct: measured" in md and "not run: stopped after tight failed" in md
