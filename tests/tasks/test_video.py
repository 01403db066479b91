"""The video task on real footage (../shared/data/video-clips, 7 unlabelled clips): labelled sets derived from them
(trainer/data/formats/video/derived.py), seed 004's frozen ResNet-18 + Transformer, cached features, resume, DDP,
folders of video files, plan and predict."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests import forkserver
from trainer.config import load_config
from trainer.engine.distributed import DistInfo
from trainer.tasks import build_task

CPU = DistInfo(0, 0, 1, torch.device("cpu"))


@pytest.fixture(scope="session")
def clip_sets(shared_data, tmp_path_factory) -> Path:
    """clip-source and arrow-of-time arrays (8 frames at stride 2, 32 px) derived from the 7 shared clips."""
    from trainer.data.formats.video.derived import write_clip_sets

    root = tmp_path_factory.mktemp("clip_sets")
    videos = sorted((shared_data / "video-clips").iterdir())
    counts = write_clip_sets(videos, root, num_frames=8, stride=2, size=32)
    assert counts["clip-source"] == {"train": 93, "val": 38}, counts
    assert counts["arrow-of-time"] == {"train": 186, "val": 76}, counts
    return root


def video_cfg(data_dir: Path, tmp_path: Path, **kw):
    """Seed 004's model, scaled down: 8-frame 32 px clips, a 2-layer Transformer of width 64, fp32 on CPU."""
    base = dict(
        task="video",
        model="frame_transformer",
        video_format="arrays",
        data_dir=str(data_dir),
        num_frames=8,
        temporal_crop="uniform",
        image_size=32,
        hflip_prob=0.0,
        batch_size=16,
        epochs=1,
        optimizer="adamw",
        lr=1e-3,
        weight_decay=0.01,
        scheduler="cosine",
        precision="32",
        device="cpu",
        num_workers=0,
        channels_last=False,
        temporal_dim=64,
        temporal_layers=2,
        temporal_heads=4,
        temporal_mlp_dim=128,
        temporal_dropout=0.0,
        checkpoint_dir=str(tmp_path / "ck"),
        log_dir=str(tmp_path / "logs"),
        log_every_steps=1000,
        checkpoint_interval=1000,
    )
    return load_config(None, {**base, **kw})


def _epochs(log_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "epoch"]


def test_metric_row_matches_the_evaluator():
    from catalog.metrics import TASK_METRICS
    from trainer.tasks.video.task import VideoTask

    keys = set(VideoTask.evaluator_class().directions)
    assert {k.removeprefix("ema_").removeprefix("val_") for k in TASK_METRICS["video"] if "val_" in k} == keys


def test_seed004_config_loads_and_checks():
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "seed004_video_g5.yaml")
    assert (cfg.task, cfg.model, cfg.num_frames, cfg.image_size, cfg.batch_size, cfg.epochs) == (
        "video",
        "frame_transformer",
        32,
        64,
        16,
        30,
    )
    task = build_task(cfg, CPU)
    task.check_config()
    assert task.loader_sample_bytes() == 32 * 512 * 2  # cached float16 features per clip


def test_cache_needs_frames_no_augmentation_changes(clip_sets, tmp_path):
    from trainer.errors import ConfigError

    cfg = video_cfg(clip_sets / "clip-source", tmp_path, cache_features=True, hflip_prob=0.5)
    with pytest.raises(ConfigError, match=r"^cache_features: hflip_prob is 0.5"):
        build_task(cfg, CPU).check_config()


def test_cached_features_give_the_uncached_first_step_loss(clip_sets, tmp_path):
    """The same first batch through the frozen backbone live, and through its cached float16 features."""
    from trainer.data.sampler import EpochSampler

    losses, hit = [], []
    for cached in (False, True, True):
        cfg = video_cfg(clip_sets / "clip-source", tmp_path, cache_features=cached)
        task = build_task(cfg, CPU)
        task.check_config()
        data = task.build_data()
        hit.append([line for line in data.report if "feature cache" in line])
        torch.manual_seed(cfg.seed)
        model = task.build_model(data.num_outputs).train()
        order = list(EpochSampler(len(data.train), 0, 1, shuffle=True, seed=cfg.seed))[:16]
        batch = task.train_batch(data.collate([data.train[k] for k in order]))
        assert ("features" in batch) == cached
        losses.append(task.model_step(model, batch).loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-3), losses
    assert losses[2] == losses[1]
    assert "filled" in hit[1][0] and "hit" in hit[2][0]  # the second cached run reuses the cache


def test_clip_source_beats_chance_on_two_ranks(clip_sets, tmp_path):
    """Which of the 7 videos is a window from (train: the first 70 % of each video, val: the last 30 %): seed 004's
    model on cached features, 2 gloo ranks under torchrun. Majority class (vtest) = 15/38 = 39.5 % of val."""
    from conftest import run_trainer

    cfg = video_cfg(clip_sets / "clip-source", tmp_path, cache_features=True, epochs=12, use_ema=True, ema_decay=0.9)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    r = run_trainer(["--config", str(tmp_path / "c.yaml")], torchrun_nproc=2, timeout=900, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    epochs = _epochs(tmp_path / "logs")
    assert len(epochs) == 12
    best = max(e["val_top1"] for e in epochs)
    assert best >= 39.5 + 25, [e["val_top1"] for e in epochs]
    assert (tmp_path / "feature-cache").is_dir()


def test_video_sigterm_resume_is_bit_exact(clip_sets, tmp_path):
    """Uncached frames with random temporal crops (4 of 8 frames) and flips, EMA, 1 loader worker: SIGTERM mid-epoch,
    resume, and the final state equals an uninterrupted run's."""
    from test_interruption import REPO, _assert_same_state, _env, _final_state, _run_until

    def command(name: str) -> list[str]:
        out = tmp_path / name
        cfg = video_cfg(
            clip_sets / "clip-source",
            out,
            epochs=2,
            num_frames=4,
            temporal_crop="random",
            hflip_prob=0.5,
            batch_size=8,
            max_steps_per_epoch=3,
            use_ema=True,
            ema_decay=0.9,
            num_workers=1,
            log_every_steps=1,
            checkpoint_interval=1,
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / "c.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
        return [sys.executable, "-m", "trainer", "train", "--config", str(out / "c.yaml")]

    env = _env(OMP_NUM_THREADS="1")
    p = forkserver.run(command("reference"), cwd=REPO, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    cmd = command("interrupted")
    rc, log = _run_until(cmd, 4, signal.SIGTERM, env=env, timeout=900)  # global step 4: inside the second epoch
    assert rc == 75 and "interrupted: SIGTERM" in log, log[-3000:]
    p = forkserver.run(cmd, cwd=REPO, env=env, timeout=900)
    assert p.returncode == 0 and "the previous run was interrupted: SIGTERM" in p.stdout, p.stderr[-3000:]
    ref, resumed = _final_state(tmp_path / "reference"), _final_state(tmp_path / "interrupted")
    _assert_same_state(ref, resumed)
    assert [h["val_top1"] for h in ref["history"]] == [h["val_top1"] for h in resumed["history"]]


@pytest.fixture
def clip_folders(shared_data, tmp_path) -> Path:
    """The Kinetics/UCF101 layout: each shared clip is its own class, in train/ and val/ (symlinks)."""
    root = tmp_path / "videos"
    for split in ("train", "val"):
        for f in sorted((shared_data / "video-clips").iterdir()):
            d = root / split / f.stem
            d.mkdir(parents=True)
            (d / f.name).symlink_to(f)
    return root


def test_video_folders_train_predict_and_plan(clip_folders, tmp_path, capsys):
    """Video files decoded in a loader worker (h264, Cinepak, MS-MPEG4), one epoch; then ``predict`` prints the
    top-k classes per clip and ``plan`` prices the config."""
    from trainer.engine.trainer import Trainer
    from trainer.predict import PREDICTIONS_FILE, add_predict_command  # noqa: F401

    cfg = video_cfg(
        clip_folders, tmp_path, video_format="folders", num_frames=4, frame_stride=4, batch_size=7, num_workers=1
    )
    t = Trainer(cfg, CPU)
    last = t.fit()
    t.close()
    assert {"val_top1", "val_top5", "val_loss"} <= set(last)
    from trainer.cli import main

    out = tmp_path / "pred"
    rc = main(
        [
            "predict",
            "--checkpoint",
            str(tmp_path / "ck"),
            "--images",
            str(clip_folders / "val" / "tree"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tree.avi: " in printed and "predict: 1 images" in printed
    records = json.loads((out / PREDICTIONS_FILE).read_text())
    assert records[0]["file"] == "tree.avi" and len(records[0]["top5"]) == 5
    assert (out / "tree.png").exists()


def test_plan_prices_seed004_and_flags_its_four_job_incident():
    """The shipped seed 004 config through ``plan`` (the video task's clip shapes, frozen backbone under fake
    tensors, its dataset estimate from --dataset-size): 1-3 jobs fit a g5.2xlarge, 4 are an ERROR row."""
    from trainer.planning.memory import predict_step_memory
    from trainer.planning.options import PlanOptions
    from trainer.planning.plan import make_plan, verdict

    cfg = load_config(
        Path(__file__).resolve().parents[2] / "configs" / "seed004_video_g5.yaml", {"cache_features": False}
    )
    predicted = {}

    def predict_once(config, micro, **kw):
        """The three plans ask for the same fake-tensor prediction (one process per GPU whatever K is): run it
        once."""
        key = (micro, tuple(sorted(kw.items())))
        if key not in predicted:
            predicted[key] = predict_step_memory(config, micro, **kw)
        return predicted[key]

    rows = {}
    for k in (1, 3, 4):
        opts = PlanOptions(instances=("g5.2xlarge",), dataset_size=8000, jobs_per_instance=k)
        plan = make_plan(cfg, opts, predict=predict_once)
        rows[k] = plan["rows"][0]
    assert len(predicted) == 1
    assert plan["image_size"] == [64, 64]
    assert 0.5 < rows[1]["memory_per_gpu_gib"] < 2.0  # 32 x 64 x 64 clips at batch 16, bf16, context included
    assert rows[1]["host_ram"]["dataset_bytes"] == 8000 * 32 * 64 * 64 * 3  # one .npz copy in its one worker
    assert verdict(rows[1]) == verdict(rows[3]) == "yes"
    assert verdict(rows[4]) == "ERROR" and "busy processes" in " ".join(rows[4]["errors"])


class _Lengths:
    """A clip source of given (label, frame count) pairs: all _check_rejected_clips reads."""

    def __init__(self, clips):
        self.clips = clips

    def __len__(self):
        return len(self.clips)

    def label(self, i):
        return self.clips[i][0]

    def num_frames(self, i):
        return self.clips[i][1]


def test_short_clips_reject_is_counted_before_training_and_never_empties_a_class(tmp_path):
    from trainer.errors import DataError
    from trainer.tasks.video.task import _check_rejected_clips

    cfg = video_cfg(tmp_path, tmp_path, short_clips="reject", frame_stride=2, max_bad_fraction=0.5)  # span 15
    ok = _Lengths([(0, 30), (0, 10), (1, 30), (1, 15)])
    assert _check_rejected_clips(ok, "train", ["a", "b"], cfg) == [
        "data: train: 1 of 4 clips too short, rejected (a 1/2)"
    ]
    assert _check_rejected_clips(_Lengths([(0, 15), (1, 16)]), "val", ["a", "b"], cfg) == []
    with pytest.raises(DataError, match=r"short_clips: reject \(val, .*15 frames.*every clip of class b is too short"):
        _check_rejected_clips(_Lengths([(0, 30), (0, 30), (0, 30), (1, 14)]), "val", ["a", "b"], cfg)
    with pytest.raises(DataError, match=r"3 of 5 clips are too short, more than max_bad_fraction 0.5"):
        _check_rejected_clips(_Lengths([(0, 30), (0, 3), (1, 3), (1, 30), (1, 3)]), "train", ["a", "b"], cfg)
