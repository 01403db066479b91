"""Which checkpoints pruning keeps (``keep_last_checkpoints``): the newest N complete ones by global step, besides
``latest``, ``best`` and the epoch ends ``checkpoint_interval`` keeps. With N = 1 the previous checkpoint goes the
moment a newer one is durable here, too soon for a copy of the folder that lags behind it (SageMaker's upload to
S3: tests/sagemaker/test_checkpoint_sync.py)."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, TrainConfig
from trainer.engine.checkpoint import CheckpointManager


def _names(mgr: CheckpointManager) -> list[str]:
    return sorted(p.name for p in mgr.dir.iterdir() if p.name.startswith("ckpt-"))


def _save(mgr: CheckpointManager, step: int, epoch: int = 0, step_in_epoch: int | None = None) -> None:
    progress = {"epoch": epoch, "step_in_epoch": step if step_in_epoch is None else step_in_epoch, "global_step": step}
    mgr.save({"w": torch.full((4,), float(step))}, progress, blocking=True)


@pytest.mark.parametrize("keep_last, kept", [(1, ["ckpt-000000006-m"]), (2, ["ckpt-000000004-m", "ckpt-000000006-m"])])
def test_the_newest_n_mid_epoch_checkpoints_are_kept(tmp_path, keep_last, kept):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=keep_last)
    for step in (2, 4, 6):
        _save(mgr, step)
    assert _names(mgr) == kept
    mgr.close()


def test_an_epoch_end_supersedes_the_mid_epoch_checkpoint_of_its_step(tmp_path):
    """The checkpoint written before an evaluation (``ckpt-8-m``) and the epoch end after it (``ckpt-8``) are one
    step: the epoch end counts, its twin goes, and the periodic ``ckpt-6-m`` is the second newest kept."""
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2)
    for step in (2, 4, 6, 8):
        _save(mgr, step)
    _save(mgr, 8, epoch=1, step_in_epoch=0)
    assert _names(mgr) == ["ckpt-000000006-m", "ckpt-000000008"]
    _save(mgr, 10, epoch=1, step_in_epoch=2)
    _save(mgr, 12, epoch=1, step_in_epoch=4)  # the epoch end stays (checkpoint_interval 1), 10 is the second newest
    assert _names(mgr) == ["ckpt-000000008", "ckpt-000000010-m", "ckpt-000000012-m"]
    mgr.close()


def test_a_folder_without_a_manifest_is_left_alone_and_counts_for_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2)
    _save(mgr, 2)
    (mgr.dir / "ckpt-000000003-m").mkdir()  # e.g. a partial copy from elsewhere: not ours to judge
    _save(mgr, 4)
    _save(mgr, 6)
    assert _names(mgr) == ["ckpt-000000003-m", "ckpt-000000004-m", "ckpt-000000006-m"]
    mgr.close()


def test_keep_last_checkpoints_is_at_least_one():
    assert TrainConfig().keep_last_checkpoints == 2
    with pytest.raises(ConfigError, match=r"^keep_last_checkpoints: got 0; must be an integer >= 1$"):
        TrainConfig(keep_last_checkpoints=0).validate()
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager("unused", keep_last=0)
