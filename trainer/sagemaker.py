"""SageMaker training-job environment: detection and the defaults it implies.

Inside a SageMaker training container (``SM_TRAINING_ENV`` set, or ``/opt/ml/input/config/resourceconfig.json``
present) checkpoints belong in ``/opt/ml/checkpoints``: SageMaker uploads that folder to the job's
``CheckpointConfig.S3Uri`` and restores it when a managed-spot job restarts (AWS docs, "Use checkpoints in
Amazon SageMaker"). SIGTERM may never reach the training process there, so periodic checkpoints are turned on.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from trainer.config import FIELDS, TrainConfig
from trainer.sm_env import DEFAULT_ROOT, ROOT_ENV

DEFAULT_PERIODIC_MINUTES = 10.0


def job_root() -> Path:
    """The SageMaker root (``$TRAINSTACK_SM_ROOT``, default /opt/ml), the one trainer/sm_env.py reads."""
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def in_sagemaker() -> bool:
    """True inside a SageMaker training job container."""
    return bool(os.environ.get("SM_TRAINING_ENV")) or (job_root() / "input/config/resourceconfig.json").is_file()


def apply_defaults(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """Return ``cfg`` with SageMaker defaults for fields left at their defaults, and log lines saying so."""
    if not in_sagemaker():
        return cfg, []
    changes, notes = {}, []
    if cfg.checkpoint_dir == FIELDS["checkpoint_dir"].default:
        changes["checkpoint_dir"] = str(job_root() / "checkpoints")
    if cfg.checkpoint_every_minutes == 0 and cfg.checkpoint_every_steps == 0:
        changes["checkpoint_every_minutes"] = DEFAULT_PERIODIC_MINUTES
    for k, v in changes.items():
        notes.append(f"sagemaker: {k}={v} (SageMaker syncs /opt/ml/checkpoints to S3; SIGTERM may not arrive)")
    return dataclasses.replace(cfg, **changes), notes
