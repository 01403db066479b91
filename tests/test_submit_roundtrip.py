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
from trainer.sm_env import hyperparameter_flags

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


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
    diff = {f.name: (getattr(local, f.name), getattr(sent, f.name)) for f in dataclasses.fields(local)
            if f.name not in skip and getattr(local, f.name) != getattr(sent, f.name)}
    assert not diff, diff
