"""Every shipped training config through ``plan`` (configs/*.yaml, the scaling plan excluded: it is a list of phases
for ``scale``), with EMA on, so every task's model is deep-copied as the EMA copy under the fake-tensor memory
prediction. Seed 003's documented command (docs/planning.md) is one of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trainer.cli import main

CONFIGS = sorted(
    p
    for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")
    if "phases" not in yaml.safe_load(p.read_text())
)


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_each_shipped_config_plans_with_ema(config, tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "--config", str(config), "--dataset-size", "1281167", "--platform", "ec2"]
    assert main([*args, "--instances", "g5.2xlarge", "--use-ema", "--out", str(out)]) == 0, capsys.readouterr().err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["memory_source"].startswith("predicted") and row["memory_per_gpu_gib"] > 0
