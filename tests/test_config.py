"""Config: YAML keys of seed 002, flags of seed 003, validation messages that name the field."""

from __future__ import annotations

import shlex

import pytest

from trainer.cli import parse_train_config
from trainer.config import ConfigError, TrainConfig, load_config

SEED_002_YAML = """\
batch_size: 256          # Good GPU utilization without OOM
num_workers: 12          # 75% of CPU cores (16 * 0.75)
prefetch_factor: 3       # Conservative buffering
pin_memory: true         # Faster CPU->GPU transfer
persistent_workers: true # Reduce worker restart overhead
compile_model: true      # PyTorch 2.0+ compilation
mixup_alpha: 0.0        # Disabled for max speed
cutmix_alpha: 0.0       # Disabled for max speed
label_smoothing: 0.1    # Minimal overhead
lr: 0.5                 # Scaled for batch_size=256
precision: 16-mixed     # FP16 for speed
"""

# Seed 003's command, minus `--use-ffcv --ffcv-dir /data/ffcv` (the FFCV issue).
SEED_003_FLAGS = """--batch-size 2048 --epochs 60 --lr 0.8 --warmup-epochs 8 --scheduler onecycle --momentum 0.9
  --weight-decay 1e-4 --label-smoothing 0.1 --gradient-clip 1.0 --cutmix-prob 0.3 --mixup-alpha 0.2
  --progressive-resize --use-ema --amp --checkpoint-dir /data/checkpoints --log-dir /data/logs
  --checkpoint-interval 5 --auto-resume --target-accuracy 78 --num-workers 24"""


def test_seed_002_yaml_keys(tmp_path):
    p = tmp_path / "single_gpu_full.yaml"
    p.write_text(SEED_002_YAML)
    cfg = load_config(p)
    assert (cfg.batch_size, cfg.num_workers, cfg.prefetch_factor) == (256, 12, 3)
    assert cfg.pin_memory and cfg.persistent_workers and cfg.compile  # compile_model is an alias
    assert (cfg.mixup_alpha, cfg.cutmix_alpha, cfg.label_smoothing, cfg.lr) == (0.0, 0.0, 0.1, 0.5)
    assert cfg.precision == "16-mixed"


def test_seed_003_flags():
    cfg = parse_train_config(shlex.split(SEED_003_FLAGS))
    assert cfg.batch_size == 2048 and cfg.epochs == 60 and cfg.lr == 0.8 and cfg.warmup_epochs == 8
    assert cfg.scheduler == "onecycle" and cfg.momentum == 0.9 and cfg.weight_decay == 1e-4
    assert cfg.gradient_clip == 1.0 and cfg.cutmix_prob == 0.3 and cfg.mixup_alpha == 0.2
    assert cfg.progressive_resize and cfg.use_ema and cfg.precision == "amp" and cfg.auto_resume
    assert cfg.checkpoint_dir == "/data/checkpoints" and cfg.checkpoint_interval == 5
    assert cfg.target_accuracy == 78.0 and cfg.num_workers == 24
    assert cfg.micro_batch_size(8) == 256
    assert not parse_train_config(["--no-auto-resume"]).auto_resume
    assert parse_train_config(["--resume", "/x/ckpt-000000010"]).resume == "/x/ckpt-000000010"
    assert parse_train_config(["--no-amp"]).precision == "32"


def test_flags_override_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lr: 0.3\nepochs: 5\n")
    cfg = parse_train_config(["--config", str(p), "--lr", "0.2", "--accumulate-grad-batches", "2",
                              "--channels-last", "--compile", "--seed", "7"])
    assert (cfg.lr, cfg.epochs, cfg.accumulate_grad_batches, cfg.seed) == (0.2, 5, 2, 7)
    assert cfg.channels_last and cfg.compile


@pytest.mark.parametrize("overrides, field, allowed", [
    ({"scheduler": "linear"}, "scheduler", "onecycle, cosine, step"),
    ({"batch_size": 0}, "batch_size", ">= 1"),
    ({"lr": -1}, "lr", "> 0"),
    ({"label_smoothing": 1.5}, "label_smoothing", "[0.0, 1.0)"),
    ({"precision": "fp8"}, "precision", "amp, 32, bf16-mixed, 16-mixed"),
    ({"warmup_epochs": 100, "epochs": 10}, "warmup_epochs", "< epochs"),
    ({"use_ema": "maybe"}, "use_ema", "true or false"),
    ({"epochs": 2.5}, "epochs", "integer"),
    ({"target_accuracy": 178}, "target_accuracy", "(0, 100]"),
    ({"cutmix_prob": 1.3}, "cutmix_prob", "[0, 1]"),
    ({"image_size": 100000}, "image_size", "must be <= 8192 pixels"),
    ({"progressive_min_size": 9000}, "progressive_min_size", "must be <= 8192 pixels"),
    ({"val_resize_ratio": 0}, "val_resize_ratio", "(0, 1]"),
])
def test_invalid_values_name_the_field(overrides, field, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(field) and allowed in str(e.value)


def test_unknown_yaml_key_suggests(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("batchsize: 12\n")
    with pytest.raises(ConfigError, match=r"batchsize \(in .*c.yaml\): unknown config key; did you mean batch_size"):
        load_config(p)


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "c.yaml"
    p.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(p)


def test_precision_aliases():
    assert load_config(None, {"precision": "bf16"}).precision == "bf16-mixed"
    assert load_config(None, {"precision": "32-true"}).precision == "32"


def test_micro_batch_divisibility():
    cfg = TrainConfig(batch_size=100, accumulate_grad_batches=2).validate()
    assert cfg.micro_batch_size(2) == 25
    with pytest.raises(ConfigError, match=r"batch_size: global batch 100 is not divisible by world_size \(3\).*multiple of 6"):
        cfg.micro_batch_size(3)


def test_fingerprint_ignores_paths_only():
    a = TrainConfig()
    assert a.fingerprint() == TrainConfig(checkpoint_dir="/elsewhere", num_workers=3).fingerprint()
    assert a.fingerprint() != TrainConfig(lr=0.2).fingerprint()


def test_cli_rejects_choice_before_start(capsys):
    from trainer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--scheduler", "linear"])
    assert e.value.code == 2 and "--scheduler" in capsys.readouterr().err


def test_cli_reports_invalid_value(capsys):
    from trainer.cli import main

    assert main(["train", "--label-smoothing", "2"]) == 2
    assert "label_smoothing: got 2.0; must be in [0.0, 1.0)" in capsys.readouterr().err


def test_help_lists_every_field(capsys):
    from trainer.cli import main
    from trainer.config import FIELDS

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert all("--" + name.replace("_", "-") in out for name in FIELDS if name != "data_dir")
    assert "--data-dir" in out and "--amp" in out


@pytest.mark.parametrize("argv", [["train", "--bogus"], ["train", "--epochs", "2", "--bogus", "x"]])
def test_unknown_flag_prints_the_sub_command_usage(argv, capsys):
    from trainer.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[0].startswith("usage: python -m trainer train ")
    unknown = " ".join(argv[argv.index("--bogus"):])
    assert err[-1] == f"python -m trainer train: error: unrecognized arguments: {unknown}"
