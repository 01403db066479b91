"""What `python -m infra submit` sends is what the image's `train` entrypoint trains: every shipped config,
turned into SageMaker hyperparameters by the CLI and back into trainer flags by the entrypoint, gives the same
TrainConfig (but for the fields SageMaker owns: data, checkpoint and log dirs)."""

from __future__ import annotations

import dataclasses

import pytest

from infra.cli.jobs import PLATFORM_FIELDS, hyperparameters
from tests.infra_helpers import REPO
from trainer.cli import parse_train_config
from trainer.config import load_config
from trainer.sagemaker.job import hyperparameter_flags

CONFIGS = [p for p in sorted((REPO / "configs").glob("*.yaml")) if not p.name.endswith("_scaling.yaml")]


def test_default_scaling_phases_are_valid_entrypoint_hyperparameters():
    """infra's default seed-001 phases (sent as HyperParameters by the state machine) start, not exit 2."""
    from infra.config import InfraConfig

    for phase in InfraConfig().scaling_phases:
        parse_train_config(hyperparameter_flags(phase.get("hyperparameters", {})))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_survives_the_trip_through_sagemaker(path):
    hps = hyperparameters(str(path), {"seed": "7"})
    assert all(isinstance(v, str) for v in hps.values())  # SageMaker stores strings only
    sent = parse_train_config(hyperparameter_flags(hps))
    local = load_config(path, {"seed": 7})
    skip = set(PLATFORM_FIELDS)
    diff = {
        f.name: (getattr(local, f.name), getattr(sent, f.name))
        for f in dataclasses.fields(local)
        if f.name not in skip and getattr(local, f.name) != getattr(sent, f.name)
    }
    assert not diff, diff


def test_a_config_nested_by_section_survives_the_trip_flat(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        "run: {model: resnet18, epochs: 3, target_accuracy: 70}\noptim: {lr: 0.05, warmup_epochs: 1}\n"
        "loader: {batch_size: 64}\ndata: {data_dir: /data/x, image_size: 160}\ncompile_model: true\n"
    )
    hps = hyperparameters(str(nested), {})
    assert hps["lr"] == "0.05" and hps["target_value"] == "70" and hps["compile"] == "true"
    assert "optim" not in hps and "data_dir" not in hps  # flat field names; SageMaker owns the data dir
    sent = parse_train_config(hyperparameter_flags(hps))
    local = load_config(nested)
    assert (
        (sent.lr, sent.batch_size, sent.image_size, sent.target_value, sent.compile)
        == (local.lr, local.batch_size, local.image_size, local.target_value, local.compile)
        == (0.05, 64, 160, 70.0, True)
    )
