"""Config: YAML keys of seed 002, flags of seed 003, validation messages that name the field."""

from __future__ import annotations

import argparse
import re
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
    assert cfg.target_value == 78.0 and cfg.target_metric is None and cfg.num_workers == 24
    assert cfg.micro_batch_size(8) == 256
    assert not parse_train_config(["--no-auto-resume"]).auto_resume
    assert parse_train_config(["--resume", "/x/ckpt-000000010"]).resume == "/x/ckpt-000000010"
    assert parse_train_config(["--no-amp"]).precision == "32"


def test_flags_override_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lr: 0.3\nepochs: 5\n")
    cfg = parse_train_config(
        [
            "--config",
            str(p),
            "--lr",
            "0.2",
            "--accumulate-grad-batches",
            "2",
            "--channels-last",
            "--compile",
            "--seed",
            "7",
        ]
    )
    assert (cfg.lr, cfg.epochs, cfg.accumulate_grad_batches, cfg.seed) == (0.2, 5, 2, 7)
    assert cfg.channels_last and cfg.compile


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        ({"scheduler": "linear"}, "scheduler", "onecycle, cosine, step"),
        ({"batch_size": 0}, "batch_size", ">= 1"),
        ({"lr": -1}, "lr", "> 0"),
        ({"label_smoothing": 1.5}, "label_smoothing", "[0.0, 1.0)"),
        ({"precision": "fp8"}, "precision", "amp, 32, bf16-mixed, 16-mixed"),
        ({"warmup_epochs": 100, "epochs": 10}, "warmup_epochs", "< epochs"),
        ({"use_ema": "maybe"}, "use_ema", "true or false"),
        ({"epochs": 2.5}, "epochs", "integer"),
        ({"cutmix_prob": 1.3}, "cutmix_prob", "[0, 1]"),
        ({"image_size": 100000}, "image_size", "must be <= 8192 pixels"),
        ({"progressive_min_size": 9000}, "progressive_min_size", "must be <= 8192 pixels"),
        ({"val_resize_ratio": 0}, "val_resize_ratio", "(0, 1]"),
    ],
)
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
    with pytest.raises(
        ConfigError, match=r"batch_size: global batch 100 is not divisible by world_size \(3\).*multiple of 6"
    ):
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


def test_train_without_config_starts_from_the_embedded_default(capsys):
    from trainer.cli import _config_from_namespace, parse_args
    from trainer.config import EMBEDDED_DEFAULT, load_config

    cfg = _config_from_namespace(parse_args(["train"]), embedded_default=True)
    assert cfg == load_config(EMBEDDED_DEFAULT) and (cfg.model, cfg.image_size, cfg.epochs) == ("resnet18", 32, 6)
    assert f"config: {EMBEDDED_DEFAULT} (the embedded default" in capsys.readouterr().out
    assert _config_from_namespace(parse_args(["train", "--epochs", "2"]), embedded_default=True).epochs == 2
    for argv in (["--data-dir", "/d"], ["--data", "/d"], ["--task", "detection", "--data-dir", "/d"]):
        cfg = _config_from_namespace(parse_args(["train", *argv]), embedded_default=True)
        assert (cfg.model, cfg.image_size) == ("resnet50", 224), argv  # a dataset named: the field defaults
    assert _config_from_namespace(parse_args(["train"])).model == "resnet50"  # plan/probe: the field defaults


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
def test_unknown_flag_is_one_line_naming_the_sub_command(argv, capsys):
    from trainer.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    unknown = " ".join(argv[argv.index("--bogus") :])
    assert e.value.code == 2
    assert err == [f"error: train: unrecognized arguments: {unknown}; see python -m trainer train --help"]


def test_invalid_choice_is_one_line_and_help_lists_the_choices(capsys):
    from trainer.cli import main

    for flag in ("--task", "--optimizer", "--scheduler"):
        with pytest.raises(SystemExit) as e:
            main(["train", flag, "nope"])
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: train: {flag}: invalid choice: 'nope'")
        )
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for choices in (
        "Choices: classification, detection, segmentation, video.",
        "Choices: sgd, adamw.",
        "Choices: onecycle, cosine, step.",
        "Choices: amp, 32, bf16-mixed, 16-mixed.",
    ):
        assert choices in out, choices


# --- sections: nested YAML, errors, task sections, flags by section ------------------------------------------

NESTED_YAML = """\
run: {epochs: 60, seed: 3, target_accuracy: 78}
data: {data: /data/imagenet, image_size: 192}
loader:
  batch_size: 2048
  num_workers: 24
optim: {lr: 0.8, scheduler: onecycle, warmup_epochs: 8, use_ema: true}
speed: {compile_model: true, precision: bf16}
checkpoint: {checkpoint_dir: /data/checkpoints, auto_resume: false}
logging: {log_every_steps: 10}
classification: {label_smoothing: 0.1, mixup_alpha: 0.2, progressive_resize: true}
"""

FLAT_YAML = """\
epochs: 60
seed: 3
target_value: 78
data_dir: /data/imagenet
image_size: 192
batch_size: 2048
num_workers: 24
lr: 0.8
scheduler: onecycle
warmup_epochs: 8
use_ema: true
compile: true
precision: bf16-mixed
checkpoint_dir: /data/checkpoints
auto_resume: false
log_every_steps: 10
label_smoothing: 0.1
mixup_alpha: 0.2
progressive_resize: true
"""


def _load(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return load_config(p)


def _error(tmp_path, text, overrides=None) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_nested_yaml_equals_flat_yaml(tmp_path):
    nested = _load(tmp_path, NESTED_YAML, "nested.yaml")
    assert nested.to_dict() == _load(tmp_path, FLAT_YAML, "flat.yaml").to_dict()
    assert nested.target_value == 78.0 and nested.compile and nested.data_dir == "/data/imagenet"
    assert all(not isinstance(v, dict) for v in nested.to_dict().values())  # to_dict stays flat
    mixed = _load(tmp_path, "lr: 0.3\noptim: {momentum: 0.8}\nepochs: 5\nrun: {seed: 1}\nlogging:\n")
    assert (mixed.lr, mixed.momentum, mixed.epochs, mixed.seed) == (0.3, 0.8, 5, 1)


def test_yaml_fields_flattens_sections(tmp_path):
    from trainer.config import yaml_fields

    p = tmp_path / "c.yaml"
    p.write_text("lr: 0.3\noptim: {momentum: 0.8}\nspeed: {compile_model: yes}\ndata: /x\n")
    assert yaml_fields(p) == {"lr": 0.3, "momentum": 0.8, "compile": True, "data_dir": "/x"}
    p.write_text("optim: {lr: 1}\nlr: 2\n")
    with pytest.raises(ConfigError, match=r"^lr \(in .*c.yaml\): lr is given twice \(also as optim.lr\)"):
        yaml_fields(p)


def test_aliases_flat_and_inside_their_section(tmp_path):
    assert _load(tmp_path, "data: /x\n").data_dir == "/x"  # seed alias of data_dir, not the section
    assert _load(tmp_path, "data: {data: /y}\n").data_dir == "/y"
    assert _load(tmp_path, "speed: {compile_model: true}\n").compile
    assert _load(tmp_path, "compile_model: true\n").compile
    assert _load(tmp_path, "run: {target_accuracy: 78}\n").target_value == 78.0
    assert _load(tmp_path, "target_accuracy: 78\n").target_value == 78.0
    assert load_config(None, {"target_accuracy": 20}).target_value == 20.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("optim: {lrr: 0.1}\n", "optim.lrr (in {f}): unknown key in section optim; did you mean optim.lr?"),
        ("optim: {zzz: 1}\n", "optim.zzz (in {f}): unknown key in section optim (its keys: optimizer, lr,"),
        ("optim: 0.1\n", "optim (in {f}): section optim must be a mapping of field: value, got float 0.1"),
        ("data: [a, b]\n", "data (in {f}): section data must be a mapping"),
        ("optim: {image_size: 64}\n", "optim.image_size (in {f}): image_size belongs to section data"),
        ("speed: {data: /x}\n", "speed.data (in {f}): data_dir belongs to section data"),
        ("lr: 0.1\noptim: {lr: 0.2}\n", "optim.lr (in {f}): lr is given twice (also as lr)"),
        (
            "compile: true\nspeed: {compile_model: false}\n",
            "speed.compile_model (in {f}): compile is given twice (also as compile)",
        ),
        ("target_value: 1\ntarget_accuracy: 2\n", "target_accuracy (in {f}): target_value is given twice"),
        ("optim: {lr: fast}\n", "optim.lr (in {f}): got 'fast'; could not convert"),
        ("batchsize: 12\n", "batchsize (in {f}): unknown config key; did you mean batch_size"),
        ("model: [resnet50]\n", "model (in {f}): got ['resnet50']; expected a single value, not a list"),
    ],
)
def test_yaml_errors_name_the_dotted_key_and_file(tmp_path, text, expected):
    assert _error(tmp_path, text).startswith(expected.format(f=tmp_path / "c.yaml"))


def test_unknown_override_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"^batchsize \(command line\): unknown config field; did you mean batch_size"
    ):
        load_config(None, {"batchsize": 3})


def test_no_field_is_named_like_a_section():
    from trainer.config import FIELDS, FIELDS_BY_SECTION, SECTIONS

    assert not set(FIELDS) & set(SECTIONS)
    assert sorted(n for names in FIELDS_BY_SECTION.values() for n in names) == sorted(FIELDS)
    assert all(FIELDS_BY_SECTION[s] for s in SECTIONS) and list(FIELDS_BY_SECTION) == list(SECTIONS)
    assert all(f.metadata["section"] in SECTIONS and f.metadata["help"] for f in FIELDS.values())


@pytest.fixture
def two_tasks(monkeypatch):
    """A registry of two tasks, the second never imported (the config only reads the names): a registered
    task name is accepted, an unregistered one (here segmentation, taken out) is refused."""
    import trainer.registry
    import trainer.tasks

    monkeypatch.setitem(trainer.registry._REGISTRY, "detection", "nowhere.detection:DetectionTask")
    monkeypatch.delitem(trainer.registry._REGISTRY, "segmentation")
    monkeypatch.delitem(trainer.registry._REGISTRY, "video")
    return trainer.tasks.task_names()


def test_task_choices_come_from_the_registry(two_tasks, capsys):
    from trainer.cli import main

    assert two_tasks == ("classification", "detection")
    assert load_config(None, {"task": "detection"}).task == "detection"
    with pytest.raises(ConfigError, match=r"^task: got 'segmentation'; allowed: classification, detection$"):
        load_config(None, {"task": "segmentation"})
    assert parse_train_config(["--task", "detection"]).task == "detection"
    with pytest.raises(SystemExit) as e:
        main(["train", "--task", "segmentation"])
    assert e.value.code == 2 and "'classification', 'detection'" in capsys.readouterr().err


def test_task_section_fields_only_with_their_task(two_tasks, tmp_path):
    f = tmp_path / "c.yaml"
    msg = _error(tmp_path, "task: detection\nmixup_alpha: 0.2\n")
    assert msg.startswith(f"mixup_alpha (in {f}): mixup_alpha belongs to task section classification")
    assert "but task is detection" in msg
    msg = _error(tmp_path, "run: {task: detection}\nclassification: {label_smoothing: 0.1}\n")
    assert (
        msg.startswith(
            f"classification.label_smoothing (in {f}): label_smoothing belongs to task section classification"
        )
        and "task is detection" in msg
    )
    msg = _error(tmp_path, "task: detection\n", {"label_smoothing": 0.1})
    assert msg.startswith("label_smoothing (command line): label_smoothing belongs to task section classification")
    msg = _error(tmp_path, "task: classification\n", {"crop_prob": 0.0})
    assert msg.startswith("crop_prob (command line): crop_prob belongs to task section detection")
    assert load_config(None, {"task": "detection", "hflip_prob": 0.0}).hflip_prob == 0.0  # data section: shared
    # defaults (written out or not) are fine under another task, and any value is fine under the own task
    cfg = _load(tmp_path, "task: detection\nclassification: {label_smoothing: 0.0, cutmix_alpha: 1.0}\nlr: 0.2\n")
    assert cfg.task == "detection" and cfg.lr == 0.2
    assert load_config(None, {"mixup_alpha": 0.2}).mixup_alpha == 0.2
    with pytest.raises(
        ConfigError,
        match=r"^progressive_resize: got True; progressive_resize belongs to task "
        r"section classification.*task is detection",
    ):
        TrainConfig(task="detection", progressive_resize=True).validate()


def test_target_value_and_metric():
    cfg = parse_train_config(["--target-accuracy", "78"])
    assert cfg.target_value == 78.0 and isinstance(cfg.target_value, float) and cfg.target_metric is None
    cfg = parse_train_config(["--target-metric", "top5", "--target-value", "0.5"])
    assert (cfg.target_metric, cfg.target_value) == ("top5", 0.5)
    assert load_config(None, {"target_value": 178}).target_value == 178.0  # the range is the task's to check
    for overrides, match in (
        ({"target_value": "nan"}, "target_value: got nan; must be a finite number"),
        ({"target_value": "inf"}, "target_value: got inf; must be a finite number"),
        ({"target_metric": "top 1"}, "target_metric: got 'top 1'; must be a metric name"),
    ):
        with pytest.raises(ConfigError, match="^" + match.replace("(", r"\(")):
            load_config(None, overrides)
    with pytest.raises(ConfigError, match="^target_metric: got ''"):
        TrainConfig(target_metric="").validate()


def test_target_fields_do_not_change_the_trajectory():
    from trainer.config import NON_TRAJECTORY_FIELDS

    assert {"target_metric", "target_value", "target_accuracy"} <= set(NON_TRAJECTORY_FIELDS)
    assert "target_accuracy" not in TrainConfig().to_dict()
    assert TrainConfig().fingerprint() == TrainConfig(target_value=50.0, target_metric="top5").fingerprint()


def test_shipped_configs_load():
    from pathlib import Path

    configs = [
        p
        for p in sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
        if not p.name.endswith("_scaling.yaml")
    ]  # *_scaling.yaml: scaling plans (python -m trainer scale), not training configs
    assert configs
    for p in configs:
        load_config(p)
    assert load_config(Path(__file__).resolve().parents[1] / "configs" / "p4d_resnet50.yaml").target_value == 78.0


def test_help_groups_flags_by_section():
    import subprocess
    import sys
    from pathlib import Path

    from trainer.config import FIELDS, FIELDS_BY_SECTION, SECTIONS, flag_of, section_title
    from trainer.config.schema import SECTION_TITLES

    assert set(SECTION_TITLES) == set(SECTIONS)

    out = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--help"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        check=True,
    ).stdout
    starts = [out.index(f"\n{section_title(s)}:\n") for s in SECTIONS]
    assert starts == sorted(starts)  # groups in SECTIONS order
    ends = starts[1:] + [len(out)]
    for (section, line), start, end in zip(SECTIONS.items(), starts, ends):
        block = out[start:end]
        assert " ".join(line.split()[:4]) in " ".join(block.split())
        assert all(flag_of(FIELDS[n]) in block for n in FIELDS_BY_SECTION[section])
    speed = out[starts[list(SECTIONS).index("speed")] :]
    assert "--amp" in speed and "--no-amp" in speed
    options = [line.split()[0].rstrip(",") for line in out.splitlines() if line.startswith("  -")]
    assert "--target-value" in options and "--target-accuracy" not in options  # aliases hidden
    assert "--compile" in options and "--compile-model" not in options and "--data" not in options


#: "default" as a word of a help text (not ``DEFAULT``, a torchvision weights name, nor a path's ``runs/default/``).
DEFAULT_WORD = re.compile(r"(?<![/\w])[Dd]efault\b(?!/)")


def _help_of(command: str) -> tuple[str, list]:
    """(``python -m trainer COMMAND --help``'s text at 100 columns, the command parser's visible options)."""
    from trainer.cli import _command_parser, build_parser

    parser = _command_parser(build_parser(command), command)
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
    visible = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]
    return parser.format_help(), visible


def test_train_help_shows_each_default_with_its_unit_once():
    """Every field's flag says its default (argparse's "(default: X)", with the unit its help names), or its help
    text says it in words; never twice; the last line points to the full table."""
    from trainer.config import FIELDS, flag_of

    out, visible = _help_of("train")
    flat = " ".join(out.split())
    for shown in (
        "--batch-size BATCH_SIZE Global batch size: images per optimizer step over all ranks and accumulation steps. "
        "(default: 256)",
        "Peak learning rate for the global batch (no automatic scaling). (default: 0.1)",
        "(pixels, square; at most 8192). (default: 224 px)",  # --image-size
        "interruption-notice polls (IMDSv2). (default: 5 s)",  # --spot-poll-interval-s
        "Choices: sgd, adamw. (default: sgd)",
        "(default: not set)",  # --resume
    ):
        assert shown in flat, shown
    by_flag = {a.option_strings[0]: a.help for a in visible}
    for name, f in FIELDS.items():
        mentions = DEFAULT_WORD.findall(by_flag[flag_of(f)])
        assert len(mentions) == 1, (name, by_flag[flag_of(f)])
    assert all(len(DEFAULT_WORD.findall(a.help)) <= 1 for a in visible)
    assert out.rstrip().splitlines()[-1].endswith("docs/configuration.md.")
    assert len(out.splitlines()) < 600  # the usage line is one line, not one per flag


@pytest.mark.parametrize("command", ["train", "plan", "probe", "sweep"])
def test_help_groups_are_named_by_what_a_user_does_and_no_option_says_its_default_twice(command):
    """Group titles say what a user does there (never a class name such as PlanOptions); plan's and probe's own
    options say their default once (probe's --workers said "default 0,2,4 and the config's" and then
    "(default: (0, 2, 4, 8))")."""
    out, visible = _help_of(command)
    titles = [line[:-1] for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert "data" in titles and "schedule and optimizer (YAML section optim)" in titles, titles
    assert not [t for t in titles if re.search(r"[a-z][A-Z]|Options", t)], titles
    if command in ("plan", "probe"):
        assert [t for t in titles if t.startswith({"plan": "planning: ", "probe": "probing: "}[command])], titles
    twice = [(a.option_strings[0], a.help) for a in visible if len(DEFAULT_WORD.findall(a.help)) > 1]
    assert twice == []
    if command in ("plan", "probe"):
        own = [a for a in visible if a.dest.startswith("opt_")]
        assert own and all(DEFAULT_WORD.search(a.help) for a in own)
        assert "(0, 2, 4, 8)" not in out and "(default: None)" not in out


def test_import_config_does_not_import_torch():
    import subprocess
    import sys
    from pathlib import Path

    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, trainer.config; assert 'torch' not in sys.modules, 'torch'; "
            "trainer.config.load_config(None, {'lr': 0.2}); assert 'torch' not in sys.modules",
        ],
        cwd=Path(__file__).resolve().parents[1],
        check=True,
    )


def test_docs_list_every_section_and_field():
    from pathlib import Path

    from trainer.config import FIELDS, SECTIONS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert all(f"### `{s}`" in doc for s in SECTIONS)
    assert all(f"| `{n}`" in doc for n in FIELDS)


def test_decode_device_cuda_only_for_classification_imagefolder():
    assert parse_train_config(["--decode-device", "cuda"]).decode_device == "cuda"
    assert TrainConfig().decode_device == "cpu"
    with pytest.raises(ConfigError, match=r"^decode_device: got 'gpu'; allowed: cpu, cuda$"):
        TrainConfig(decode_device="gpu").validate()
    with pytest.raises(ConfigError, match=r"^decode_device: got 'cuda' with task detection; expected cpu"):
        TrainConfig(task="detection", decode_device="cuda").validate()
    with pytest.raises(ConfigError, match=r"^decode_device: got 'cuda' with use_ffcv .*; expected cpu"):
        TrainConfig(use_ffcv=True, ffcv_dir="f", decode_device="cuda").validate()
    from trainer.engine.resume import config_diff as _config_diff

    # recorded in checkpoints: a change is a config change on resume; an older checkpoint (no field) reads as cpu
    assert _config_diff({"decode_device": "cpu"}, {"decode_device": "cuda"}) == [
        "decode_device: checkpoint 'cpu' -> now 'cuda'"
    ]
    assert _config_diff({}, {"decode_device": "cpu"}) == [] and _config_diff({}, {"decode_device": "cuda"})
