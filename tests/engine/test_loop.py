"""The loop on tiny real data: learning, outputs, bit-exact resume after a completed epoch (metrics rows
once each), config-change refusal, NaN stop that keeps the last good checkpoint, all loop features together,
bad-file threshold. More bad inputs of the loop: tests/test_bad_inputs_engine.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import tiny_overrides

from trainer.config import load_config
from trainer.data.formats.imagefolder import DataError
from trainer.engine.checkpoint import CheckpointError, CheckpointManager
from trainer.engine.distributed import DistInfo
from trainer.engine.trainer import NonFiniteLossError, Trainer

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _fit(data, tmp, **kw):
    t = Trainer(load_config(None, tiny_overrides(data, tmp, **kw)), CPU)
    last = t.fit()
    t.close()
    return t, last


def test_learns_and_writes_outputs(tiny_digits, tmp_path):
    # lr on the linear-scaling rule (0.1 x 16/256), chance is 10 %: val top-1 after 3 epochs 86.2 % (seed 0) and
    # 85.0 % (seed 1) with 1 thread, 2026-12-07 (4 epochs: 82-90 %)
    t, last = _fit(tiny_digits, tmp_path, epochs=3, batch_size=16, lr=0.00625)
    assert last["val_top1"] > 40.0
    rows = [json.loads(l) for l in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert any(r["kind"] == "step" for r in rows)
    assert (tmp_path / "logs" / "curves.png").stat().st_size > 1000
    assert list((tmp_path / "logs" / "tb").glob("events.out.tfevents.*"))
    ck = tmp_path / "ckpt"
    assert (ck / "latest").read_text() == "ckpt-000000054" and (ck / "best").exists()  # 18 steps/epoch
    CheckpointManager.validate(ck / "ckpt-000000054")


def test_checkpoint_round_trip_and_resume_is_bit_exact(tiny_digits, tmp_path):
    # ShuffleNetV2 x0.5 (1.4 M parameters, batch norm like ResNet-18's): resume is exact or not whatever the
    # model; a small one makes each step and each checkpoint write several times cheaper than ResNet-18 (11.7 M)
    kw = dict(epochs=3, use_ema=True, ema_decay=0.9, mixup_alpha=0.2, cutmix_prob=0.5, model="shufflenet_v2_x0_5")
    ref, _ = _fit(tiny_digits, tmp_path / "a", **kw)
    kw["checkpoint_writer"] = "process"  # the resumed run reads what the writer process wrote
    t, _ = _fit(tiny_digits, tmp_path / "b", **kw)
    assert t.ckpt.writer == "process"
    ck = tmp_path / "b" / "ckpt"
    # Simulate a stop after epoch 2: the epoch-3 checkpoint never became durable.
    shutil.rmtree(ck / "ckpt-000000027")
    (ck / "latest").unlink()
    resumed, _ = _fit(tiny_digits, tmp_path / "b", **kw)
    assert resumed.history[-1]["epoch"] == 3 and len(resumed.history) == 3
    for (k, a), b in zip(ref.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    for a, b in zip(ref.ema.state_dict().values(), resumed.ema.state_dict().values()):
        assert torch.equal(a, b)
    # round trip: what was saved is what is loaded
    state, rng = CheckpointManager.load(ck / "ckpt-000000027")
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(state["model"][k], v)
    assert state["progress"] == {"epoch": 3, "step_in_epoch": 0, "global_step": 27} and "torch" in rng["rng"]
    # the steps the first run logged after its last durable checkpoint appear once, not twice
    rows = [json.loads(line) for line in (tmp_path / "b" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [1, 2, 3]
    steps = [r["step"] for r in rows if r["kind"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == 26


def test_auto_resume_skips_corrupt_checkpoint(tiny_digits, tmp_path):
    _fit(tiny_digits, tmp_path, epochs=2)
    ck = tmp_path / "ckpt"
    state = ck / "ckpt-000000018" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    path, notes = CheckpointManager(ck).find_resume()
    assert path.name == "ckpt-000000009"
    assert "skipping ckpt-000000018" in notes[0] and "truncated" in notes[0]


@pytest.fixture(scope="module")
def one_epoch(tiny_digits, tmp_path_factory):
    """A finished 1-epoch run of :func:`tiny_overrides`' recipe, trained once for the tests that resume from it;
    each test resumes a copy (:func:`_copy_run`)."""
    out = tmp_path_factory.mktemp("one_epoch")
    _fit(tiny_digits, out, epochs=1)
    return out


def _copy_run(run, tmp) -> None:
    """``run``'s checkpoints and logs into ``tmp`` (resume compares the training fields, not the folders)."""
    shutil.copytree(run, tmp, dirs_exist_ok=True)


def test_changed_config_is_refused_unless_forced(tiny_digits, one_epoch, tmp_path):
    _copy_run(one_epoch, tmp_path)
    saved_lr = tiny_overrides(tiny_digits, tmp_path)["lr"]
    with pytest.raises(CheckpointError, match=rf"lr: checkpoint {saved_lr} -> now 0.02"):
        Trainer(load_config(None, tiny_overrides(tiny_digits, tmp_path, epochs=1, lr=0.02)), CPU)
    t = Trainer(load_config(None, tiny_overrides(tiny_digits, tmp_path, epochs=2, force_resume=True)), CPU)
    assert t.epoch == 1 and t.global_step == 9


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_digits, one_epoch, tmp_path):
    _copy_run(one_epoch, tmp_path)
    ck = tmp_path / "ckpt"
    before = sorted(p.name for p in ck.iterdir())
    cfg = load_config(
        None,
        tiny_overrides(
            tiny_digits, tmp_path, epochs=3, lr=1e30, force_resume=True, log_every_steps=1, gradient_clip=0.0
        ),
    )
    t = Trainer(cfg, CPU)
    with pytest.raises(NonFiniteLossError, match=r"loss became NaN/inf at global step (1\d)") as e:
        t.fit()
    assert "ckpt-000000009" in str(e.value)
    assert sorted(p.name for p in ck.iterdir()) == before and (ck / "latest").read_text() == "ckpt-000000009"


def test_all_loop_features_together(tiny_digits, tmp_path):
    t, last = _fit(
        tiny_digits,
        tmp_path,
        epochs=3,
        accumulate_grad_batches=2,
        gradient_clip=1.0,
        label_smoothing=0.1,
        mixup_alpha=0.2,
        cutmix_prob=0.3,
        use_ema=True,
        ema_decay=0.9,
        progressive_resize=True,
        progressive_min_size=16,
        image_size=32,
        scheduler="cosine",
        warmup_epochs=1,
        channels_last=True,
        optimizer="adamw",
        lr=0.003,
    )
    assert [h["image_size"] for h in t.history] == [16, 16, 32]
    assert "ema_val_top1" in last and t.micro == 16 and t.steps_per_epoch == 9
    assert t.scheduler.last_epoch == 27


def test_step_scheduler_and_target_accuracy(tiny_digits, tmp_path):
    t, last = _fit(
        tiny_digits,
        tmp_path,
        epochs=6,
        scheduler="step",
        step_size_epochs=1,
        step_gamma=0.5,
        warmup_epochs=0,
        target_accuracy=20,
    )
    assert len(t.history) < 6 and last["val_top1"] >= 20


def test_too_many_bad_files_abort(shared_data, tmp_path):
    from test_data import _folder_with_bad_files

    root, _ = _folder_with_bad_files(shared_data / "hymenoptera", tmp_path / "d")
    kw = dict(batch_size=4, epochs=1, image_size=32, hflip_prob=0.5)
    with pytest.raises(
        DataError,
        match=r"train epoch 1: [12] file\(s\) could not be decoded, more than max_bad_fraction=0.01 of the 12 files",
    ):
        _fit(root, tmp_path / "r1", **kw)
    t, last = _fit(root, tmp_path / "r2", max_bad_fraction=0.2, **kw)
    assert last["bad_files"] == 2


def test_batch_larger_than_dataset(tiny_digits, tmp_path):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="batch_size: global batch 1024 is larger than the training set"):
        Trainer(load_config(None, tiny_overrides(tiny_digits, tmp_path, batch_size=1024)), CPU)


def test_time_based_periodic_checkpoints(tiny_digits, tmp_path):
    t = Trainer(load_config(None, tiny_overrides(tiny_digits, tmp_path, epochs=1, checkpoint_every_minutes=1e-9)), CPU)
    saves = []
    orig = t.save_checkpoint
    t.save_checkpoint = lambda **kw: saves.append((t.step_in_epoch, kw.get("epoch_stats") is not None)) or orig(**kw)
    t.fit()
    t.close()
    assert saves[:8] == [(i, True) for i in range(1, 9)] and saves[-1] == (0, False)  # then the epoch end
    ck = tmp_path / "ckpt"
    assert (ck / "latest").read_text() == "ckpt-000000009"
    # superseded mid-epoch ones pruned, but for the newest (keep_last_checkpoints: 2); step 9's pre-evaluation one
    # is the epoch end's twin, so it goes too
    assert sorted(p.name for p in ck.iterdir() if p.name.endswith("-m")) == ["ckpt-000000008-m"]


def test_staging_buffers_are_reused_copies(tmp_path):
    """A periodic checkpoint stages the state into host buffers kept across checkpoints (no allocation after the
    first: the stall it replaced), and what it writes is the value at save time even though training goes on changing
    the tensors before the writer thread gets to them."""
    from trainer.engine.checkpoint import CheckpointManager
    from trainer.engine.staging import StagingBuffers

    w = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "opt": [torch.ones(4), 3], "step": 1}
    staging = StagingBuffers()
    first = staging.stage(w)
    assert staging.allocated == 2 and first["model"]["w"] is not w["model"]["w"] and first["opt"][1] == 3
    w["model"]["w"].add_(100)
    assert torch.equal(first["model"]["w"], torch.arange(6.0).reshape(2, 3))  # a copy, not a view
    second = staging.stage(w)
    assert staging.allocated == 2 and second["model"]["w"] is first["model"]["w"]  # the same buffer, refilled
    assert torch.equal(second["model"]["w"], torch.arange(6.0).reshape(2, 3) + 100)
    staging.stage({**w, "model": {"w": torch.zeros(3, 3)}})
    assert staging.allocated == 3  # a new shape: a new buffer

    mgr = CheckpointManager(tmp_path / "ck")
    state = {"w": torch.zeros(1000)}
    for step in (1, 2):
        state["w"].fill_(step)
        mgr.save(state, {"epoch": 0, "step_in_epoch": step, "global_step": step})
        state["w"].fill_(-1)  # training goes on before the writer thread finishes
        mgr.wait()
    assert mgr._staging.allocated == 1
    loaded, _ = CheckpointManager.load(mgr.dir / mgr.pointer("latest"))
    assert torch.equal(loaded["w"], torch.full((1000,), 2.0))
