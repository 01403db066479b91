"""Readers of a checkpoint folder that a training run is writing and pruning: ``predict``, ``export`` and
``evaluate`` read through :meth:`CheckpointDirectory.read_newest`, which opens a checkpoint's files before it checks
and reads them (a prune after that cannot take them away) and takes the next newest one when the one it chose was
pruned before it could open it. Before, ``export`` during a run checkpointing every step crashed with
``FileNotFoundError: .../manifest.json`` and left an empty ``--out``, and ``predict`` called the pruned checkpoint
"incomplete"."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from test_bad_inputs_engine import _env, tiny_data
from test_writer_lock import _start

from trainer.engine import checkpoint_files
from trainer.engine.checkpoint import CheckpointManager
from trainer.engine.checkpoint_files import CheckpointDirectory
from trainer.errors import CheckpointError, CheckpointGone


def _save(mgr: CheckpointManager, step: int) -> None:
    mgr.save({"w": torch.full((4,), float(step))}, {"epoch": 0, "step_in_epoch": step, "global_step": step})
    mgr.wait()


def test_a_checkpoint_pruned_before_it_is_opened_is_passed_over_for_the_newer_one(tmp_path: Path, monkeypatch):
    """Deterministic: the reader chose ckpt 2 (``latest``); before it opens it, the run writes ckpt 3 and prunes
    ckpt 2. The reader takes ckpt 3 and says why, instead of crashing or calling ckpt 2 incomplete."""
    mgr = CheckpointManager(tmp_path, keep_last=1)
    _save(mgr, 1)
    _save(mgr, 2)
    real = checkpoint_files._OpenCheckpoint.__init__
    pruned = []

    def write_and_prune_first(self, path):
        if not pruned:
            pruned.append(Path(path).name)
            _save(mgr, 3)  # keep_last=1: ckpt 2 is pruned once ckpt 3 is durable
        real(self, path)

    monkeypatch.setattr(checkpoint_files._OpenCheckpoint, "__init__", write_and_prune_first)
    found, notes = CheckpointDirectory(tmp_path).read_newest()
    mgr.release_lock()
    assert pruned == ["ckpt-000000002-m"] and not (tmp_path / "ckpt-000000002-m").exists()
    assert found is not None and found.path.name == "ckpt-000000003-m", notes
    assert torch.equal(found.state["w"], torch.full((4,), 3.0)) and found.manifest["progress"]["global_step"] == 3
    assert any("passed over ckpt-000000002-m: removed while being read" in n for n in notes), notes
    assert not any(n.startswith("checkpoint: skipping ") for n in notes), notes  # nothing to warn about


def test_a_checkpoint_pruned_after_its_files_are_open_is_still_read_whole(tmp_path: Path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    _save(mgr, 5)
    mgr.release_lock()
    real = checkpoint_files._OpenCheckpoint._check

    def check_then_prune(self):
        real(self)
        shutil.rmtree(self.path)  # the writer's prune, between the reader's open and its torch.load

    monkeypatch.setattr(checkpoint_files._OpenCheckpoint, "_check", check_then_prune)
    ck = CheckpointDirectory.read(tmp_path / "ckpt-000000005-m")
    assert not (tmp_path / "ckpt-000000005-m").exists()
    assert torch.equal(ck.state["w"], torch.full((4,), 5.0)) and ck.rank_state is not None
    with pytest.raises(CheckpointError, match="no manifest.json") as e:  # not there when the read begins:
        CheckpointDirectory.read(tmp_path / "ckpt-000000005-m")  # missing, not "pruned while read"
    assert not isinstance(e.value, CheckpointGone)


def test_the_prune_renames_a_checkpoint_away_before_deleting_it(tmp_path: Path, monkeypatch):
    """A reader sees a pruned checkpoint whole or not at all: never a folder whose manifest is gone and whose
    weights are not (what ``rmtree`` in place showed a reader, who then called it incomplete)."""
    mgr = CheckpointManager(tmp_path, keep_last=1)
    _save(mgr, 1)
    seen = []
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(
        "trainer.engine.checkpoint_folder.shutil.rmtree",
        lambda p, **kw: (seen.append(Path(p).name), real_rmtree(p, **kw)),
    )
    _save(mgr, 2)
    mgr.release_lock()
    assert "ckpt-000000001-m" not in seen and ".tmp-ckpt-000000001-m-pruned" in seen, seen
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == ["ckpt-000000002-m"]


def _latest_step(ck: Path) -> int:
    return int((ck / "latest").read_text().strip().split("-")[1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_export_in_a_loop_against_a_run_checkpointing_every_step_never_crashes(tmp_path: Path):
    """Must show: ``export --format safetensors`` of the checkpoint_dir in a loop while ``train
    --checkpoint-every-steps 1 --keep-last-checkpoints 1`` prunes under it: every export exits 0 and leaves a
    complete ``--out`` (model file, config, card); ``predict``'s reader in the same loop never fails either."""
    from safetensors.torch import load_file

    from trainer.cli import main
    from trainer.trained import read_checkpoint

    tiny_data(tmp_path / "data", train=40)
    extra = dict(model="shufflenet_v2_x0_5", epochs=1000, max_steps_per_epoch=5, checkpoint_every_steps=1)
    extra.update(keep_last_checkpoints=1, checkpoint_writer="thread")
    run, out_lines = _start(tmp_path, _env(), "-m", "trainer", **extra)
    ck, exports, reads, failures = tmp_path / "ck", 0, 0, []
    try:
        deadline = time.monotonic() + 300
        while not (ck / "latest").exists():
            assert run.poll() is None and time.monotonic() < deadline, "".join(out_lines.lines[-30:])
            time.sleep(0.2)
        first = _latest_step(ck)
        while _latest_step(ck) < first + 4 or exports < 3:  # at least 4 checkpoints written and pruned meanwhile
            assert run.poll() is None and time.monotonic() < deadline, "".join(out_lines.lines[-30:])
            out = tmp_path / f"export-{exports}"
            try:
                code = main(["export", "--checkpoint", str(ck), "--format", "safetensors", "--out", str(out)])
            except BaseException as e:  # noqa: BLE001 - counted: the test's point
                code = f"{type(e).__name__}: {e}"
            if code != 0:
                failures.append((exports, code, sorted(p.name for p in out.iterdir()) if out.is_dir() else None))
            else:
                assert sorted(p.name for p in out.iterdir()) == [
                    "model.safetensors",
                    "model_card.md",
                    "train_config.yaml",
                ]
                assert load_file(str(out / "model.safetensors"))
            exports += 1
            for _ in range(3):
                try:
                    read_checkpoint(ck)
                except BaseException as e:  # noqa: BLE001
                    failures.append(("read", f"{type(e).__name__}: {e}"))
                reads += 1
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        run.wait(300)
    print(f"\n{exports} exports and {reads} reads while the run wrote and pruned steps {first} to {_latest_step(ck)}")
    assert not failures, failures
    assert exports >= 3 and reads >= 9, (exports, reads)
