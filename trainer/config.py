"""One typed training config: YAML file + command-line overrides, validated once before anything starts.

The field names are the YAML keys. They include the keys of seed 002's ``configs/single_gpu_full.yaml``
(``batch_size, num_workers, prefetch_factor, pin_memory, persistent_workers, compile_model, mixup_alpha,
cutmix_alpha, label_smoothing, lr, precision``) and every flag of seed 003's training command
(``--batch-size --epochs --lr --warmup-epochs --scheduler --momentum --weight-decay --label-smoothing
--gradient-clip --cutmix-prob --mixup-alpha --progressive-resize --use-ema --amp --checkpoint-dir --log-dir
--checkpoint-interval --auto-resume/--no-auto-resume --resume --target-accuracy --num-workers``).

Conventions (they differ between the seeds, so they are fixed here):

* ``batch_size`` is the **global batch size**: images per optimizer step summed over all ranks and all
  accumulation micro-steps (seed 003: "--batch-size 2048 = 256 per GPU x 8 GPUs"). The per-rank
  **micro-batch** is ``batch_size / (world_size * accumulate_grad_batches)`` and must be a whole number.
* ``lr`` is the peak learning rate for that global batch; it is never rescaled automatically (seed 003:
  "the code does NOT auto-scale by world_size"). A warning names linear scaling beyond 0.1 per 256 images.
* ``precision``: ``amp`` = bf16 autocast where the device supports it, fp16 autocast + GradScaler otherwise,
  fp32 on CPU; ``32`` = fp32; ``bf16-mixed`` / ``16-mixed`` force a dtype (Lightning's names, seed 002).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from trainer.errors import ConfigError  # noqa: F401 - re-exported

#: Sentinel for the embedded default dataset (scikit-learn's bundled handwritten-digit scans).
BUILTIN_DIGITS = "builtin:digits"

PRECISIONS = ("amp", "32", "bf16-mixed", "16-mixed")
_PRECISION_ALIASES = {
    "auto": "amp", "mixed": "amp",
    "32-true": "32", "fp32": "32", "float32": "32",
    "bf16": "bf16-mixed", "bfloat16": "bf16-mixed", "bf16-true": "bf16-mixed",
    "16": "16-mixed", "fp16": "16-mixed", "float16": "16-mixed",
}
SCHEDULERS = ("onecycle", "cosine", "step")
OPTIMIZERS = ("sgd", "adamw")
TASKS = ("classification",)
FFCV_ORDERS = ("random", "quasi_random")
#: Largest image side trained or evaluated on (pixels). One 8192 px RGB sample is 192 MiB as uint8 and 768 MiB as
#: float32, already beyond any GPU batch; a larger value is a typo (an extra digit), refused before anything starts.
MAX_IMAGE_SIZE = 8192


def _f(default: Any, help: str, *, flag: Optional[str] = None, choices: tuple = (), cli: bool = True,
       aliases: tuple = ()) -> Any:
    """Dataclass field with CLI metadata (help text, flag spelling, allowed values, YAML aliases)."""
    meta = {"help": help, "flag": flag, "choices": choices, "cli": cli, "aliases": aliases}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Everything a training run needs. Built by :func:`load_config`, validated by :meth:`validate`.

    Units: sizes in pixels, rates per optimizer step unless stated, times in seconds or minutes as named.
    """

    # --- task, data, model -------------------------------------------------------------------------
    task: str = _f("classification", "Task plug-in (trainer/tasks).", choices=TASKS)
    data_dir: str = _f(BUILTIN_DIGITS, "ImageFolder root with train/ and val/ class folders, or "
                       f"'{BUILTIN_DIGITS}' (scikit-learn's bundled digit scans, written once to a cache).",
                       flag="--data-dir", aliases=("data",))
    train_split: str = _f("train", "Sub-folder of data_dir used for training.")
    val_split: str = _f("val", "Sub-folder of data_dir used for evaluation.")
    use_ffcv: bool = _f(False, "Read FFCV .beton files (<ffcv_dir>/<train_split>.ffcv, <val_split>.ffcv) instead of "
                        "the ImageFolder (seed 003's --use-ffcv; needs the ffcv extra: make ffcv).")
    ffcv_dir: Optional[str] = _f(None, "Folder of the .ffcv files that python -m trainer write-ffcv makes "
                                 "(seed 003: /data/ffcv with train.ffcv and val.ffcv).")
    ffcv_order: str = _f("random", "FFCV traversal order: random (seed + epoch; single process or DDP) or "
                         "quasi_random (single process only; reads page by page, for files larger than RAM "
                         "with ffcv_os_cache off).", choices=FFCV_ORDERS)
    ffcv_os_cache: bool = _f(True, "FFCV: read through the OS page cache, shared by all ranks of a host "
                             "(ffcv-imagenet's in_memory=1); off = FFCV's own per-process page cache.")
    max_bad_fraction: float = _f(0.01, "Abort when more than this fraction of an epoch's files cannot be "
                                 "decoded (they are skipped and counted below it).")
    model: str = _f("resnet50", "Any torchvision classification model name (torchvision.models.list_models).")
    image_size: int = _f(224, f"Final training and evaluation resolution (pixels, square; at most {MAX_IMAGE_SIZE}).")
    val_resize_ratio: float = _f(0.875, "Evaluation: resize shorter side to image_size/ratio, centre-crop "
                                 "image_size (the standard ImageNet protocol).")
    crop_scale_min: float = _f(0.08, "RandomResizedCrop's lower area bound (0.08 = ImageNet default).")
    hflip_prob: float = _f(0.5, "Probability of a horizontal flip in training (0 for digits or text).")
    progressive_resize: bool = _f(False, "Train at low resolution first, then step up to image_size "
                                  "(seed 003: 160 -> 192 -> 224 over equal thirds of the epochs).")
    progressive_min_size: int = _f(160, "First resolution of progressive resizing (pixels; at most image_size).")
    progressive_stages: int = _f(3, "Number of equal-length resolution stages in progressive resizing.")

    # --- batch and loader ----------------------------------------------------------------------------
    batch_size: int = _f(256, "Global batch size: images per optimizer step over all ranks and "
                         "accumulation steps.")
    accumulate_grad_batches: int = _f(1, "Micro-batches accumulated per optimizer step on each rank.")
    eval_batch_size: int = _f(0, "Per-rank evaluation batch (0 = the training micro-batch x 2).")
    num_workers: int = _f(8, "DataLoader worker processes per rank.")
    prefetch_factor: int = _f(2, "Batches each worker loads ahead (RAM = workers x prefetch x batch bytes).")
    pin_memory: bool = _f(True, "Pin host batches for faster async host->GPU copies (ignored on CPU).")
    persistent_workers: bool = _f(True, "Keep loader workers alive between epochs.")

    # --- optimisation ----------------------------------------------------------------------------------
    epochs: int = _f(90, "Number of training epochs.")
    optimizer: str = _f("sgd", "Optimizer.", choices=OPTIMIZERS)
    lr: float = _f(0.1, "Peak learning rate for the global batch (no automatic scaling).")
    momentum: float = _f(0.9, "SGD momentum (AdamW: beta1).")
    weight_decay: float = _f(1e-4, "Decoupled (AdamW) or L2 (SGD) weight decay.")
    no_decay_norm_bias: bool = _f(True, "Exclude normalisation weights and biases from weight decay.")
    scheduler: str = _f("cosine", "LR schedule after warmup (OneCycle includes its own warmup).",
                        choices=SCHEDULERS)
    warmup_epochs: float = _f(0.0, "Linear warmup length in epochs (fractions allowed).")
    step_size_epochs: int = _f(30, "step scheduler: epochs between LR drops.")
    step_gamma: float = _f(0.1, "step scheduler: LR multiplier at each drop.")
    label_smoothing: float = _f(0.0, "Label smoothing for the cross-entropy loss, in [0, 1).")
    gradient_clip: float = _f(0.0, "Clip the global gradient L2 norm to this value (0 = off).")
    mixup_alpha: float = _f(0.0, "MixUp Beta(alpha, alpha) parameter (0 = MixUp off).")
    cutmix_alpha: float = _f(1.0, "CutMix Beta(alpha, alpha) parameter (0 = CutMix off).")
    cutmix_prob: float = _f(0.0, "Share of batches mixed with CutMix; the rest use MixUp when "
                            "mixup_alpha > 0, otherwise stay unmixed.")
    use_ema: bool = _f(False, "Keep an exponential moving average of the weights and evaluate it too.")
    ema_decay: float = _f(0.9998, "EMA decay per optimizer step.")
    seed: int = _f(0, "Seed for weights, data order and augmentation (all ranks derive from it).")

    # --- speed -----------------------------------------------------------------------------------------
    precision: str = _f("amp", "amp | 32 | bf16-mixed | 16-mixed (see module doc).", choices=PRECISIONS)
    channels_last: bool = _f(True, "Use the channels_last memory format for model and inputs.")
    compile: bool = _f(False, "torch.compile the model.", aliases=("compile_model",))
    tf32: bool = _f(True, "Allow TF32 matmul/conv on Ampere and newer GPUs.")
    device: str = _f("auto", "auto | cpu | cuda.", choices=("auto", "cpu", "cuda"))

    # --- checkpoints, logs, stopping ------------------------------------------------------------------
    checkpoint_dir: str = _f("runs/default/checkpoints", "Where checkpoints go.")
    checkpoint_interval: int = _f(1, "Keep a checkpoint every N epochs (the latest and the best are "
                                  "always kept).")
    auto_resume: bool = _f(True, "At start, resume from the newest complete checkpoint in checkpoint_dir.")
    resume: Optional[str] = _f(None, "Resume from this checkpoint directory (overrides auto_resume).")
    force_resume: bool = _f(False, "Resume even if training-relevant config fields changed since the "
                            "checkpoint (they are listed); a changed schedule restarts at the saved step.")
    checkpoint_every_steps: int = _f(0, "Also checkpoint every N optimizer steps, mid-epoch (0 = off); bounds "
                                     "what a SIGKILL loses.")
    checkpoint_every_minutes: float = _f(0.0, "Also checkpoint every N minutes of training, mid-epoch (0 = off; "
                                         "inside SageMaker 10 by default, since SIGTERM may not reach us there).")
    spot_poll_interval_s: float = _f(5.0, "Seconds between EC2 spot interruption-notice polls (IMDSv2).")
    stop_on_rebalance: bool = _f(False, "Also checkpoint and stop on an EC2 rebalance recommendation.")
    log_dir: str = _f("runs/default/logs", "Metrics JSONL, TensorBoard events and the curves PNG go here.")
    log_every_steps: int = _f(50, "Plain progress line every N optimizer steps (no terminal attached).")
    target_accuracy: Optional[float] = _f(None, "Stop once validation top-1 (%, EMA or raw) reaches this.")
    max_steps_per_epoch: int = _f(0, "Cap optimizer steps per epoch (0 = full epoch); for smoke runs.")

    # ------------------------------------------------------------------------------------------------
    def validate(self) -> "TrainConfig":
        """Check every field; raise :class:`ConfigError` naming the first bad field and what is allowed.

        Returns ``self`` so calls can chain. Cross-rank checks (micro-batch divisibility) live in
        :meth:`micro_batch_size`, which needs the world size.
        """
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{f.name}: got {value!r}; allowed: {', '.join(map(str, choices))}")
        _positive = ("batch_size", "accumulate_grad_batches", "epochs", "image_size", "checkpoint_interval",
                     "log_every_steps", "progressive_stages", "progressive_min_size", "step_size_epochs")
        for name in _positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: got {getattr(self, name)!r}; must be an integer >= 1")
        for name in ("image_size", "progressive_min_size"):
            if getattr(self, name) > MAX_IMAGE_SIZE:
                raise ConfigError(f"{name}: got {getattr(self, name)!r}; must be <= {MAX_IMAGE_SIZE} pixels "
                                  "(one side of the square image)")
        for name in ("num_workers", "eval_batch_size", "max_steps_per_epoch", "checkpoint_every_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: got {getattr(self, name)!r}; must be an integer >= 0")
        if self.prefetch_factor < 1:
            raise ConfigError(f"prefetch_factor: got {self.prefetch_factor}; must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr: got {self.lr!r}; must be a finite number > 0")
        for name, lo, hi in (("label_smoothing", 0.0, 1.0), ("max_bad_fraction", 0.0, 1.0),
                             ("ema_decay", 0.0, 1.0)):
            v = getattr(self, name)
            if not (lo <= v < hi):
                raise ConfigError(f"{name}: got {v!r}; must be in [{lo}, {hi})")
        for name in ("cutmix_prob", "hflip_prob", "momentum"):
            v = getattr(self, name)
            if not (0.0 <= v <= 1.0):
                raise ConfigError(f"{name}: got {v!r}; must be in [0, 1]")
        for name in ("crop_scale_min", "val_resize_ratio"):
            v = getattr(self, name)
            if not (0.0 < v <= 1.0):
                raise ConfigError(f"{name}: got {v!r}; must be in (0, 1]")
        if self.spot_poll_interval_s <= 0:
            raise ConfigError(f"spot_poll_interval_s: got {self.spot_poll_interval_s}; must be > 0")
        for name in ("mixup_alpha", "cutmix_alpha", "weight_decay", "gradient_clip", "warmup_epochs",
                     "checkpoint_every_minutes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: got {getattr(self, name)!r}; must be >= 0")
        if self.warmup_epochs >= self.epochs:
            raise ConfigError(f"warmup_epochs: got {self.warmup_epochs}; must be < epochs ({self.epochs})")
        if not 0 < self.step_gamma <= 1:
            raise ConfigError(f"step_gamma: got {self.step_gamma}; must be in (0, 1]")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 100:
            raise ConfigError(f"target_accuracy: got {self.target_accuracy}; must be a percentage in (0, 100]")
        if self.progressive_resize and self.progressive_min_size > self.image_size:
            raise ConfigError(f"progressive_min_size: got {self.progressive_min_size}; must be <= image_size "
                              f"({self.image_size})")
        if not self.data_dir:
            raise ConfigError("data_dir: empty; give an ImageFolder root or " + BUILTIN_DIGITS)
        if self.use_ffcv and not self.ffcv_dir:
            raise ConfigError("ffcv_dir: required with use_ffcv (the folder holding "
                              f"{self.train_split}.ffcv and {self.val_split}.ffcv; see python -m trainer write-ffcv)")
        return self

    def micro_batch_size(self, world_size: int) -> int:
        """Per-rank images per forward/backward: ``batch_size / (world_size * accumulate_grad_batches)``.

        Raises:
            ConfigError: the global batch does not split evenly into whole micro-batches.
        """
        denom = world_size * self.accumulate_grad_batches
        if self.batch_size % denom:
            raise ConfigError(
                f"batch_size: global batch {self.batch_size} is not divisible by world_size ({world_size}) x "
                f"accumulate_grad_batches ({self.accumulate_grad_batches}) = {denom}; choose a multiple of {denom}")
        return self.batch_size // denom

    def to_dict(self) -> dict:
        """Plain dict of all fields (YAML/JSON-serialisable)."""
        return dataclasses.asdict(self)

    def fingerprint(self, exclude: tuple = ()) -> str:
        """SHA-256 (hex, 16 chars) of the fields that define the training trajectory.

        Fields that only say where things go or how often to log are excluded, so moving a run to another
        checkpoint directory does not change it.
        """
        d = {k: v for k, v in self.to_dict().items() if k not in NON_TRAJECTORY_FIELDS + tuple(exclude)}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


#: Fields that do not change what is computed (paths, logging, resume switches, loader tuning).
NON_TRAJECTORY_FIELDS = ("checkpoint_dir", "log_dir", "auto_resume", "resume", "force_resume", "log_every_steps",
                         "checkpoint_interval", "target_accuracy", "num_workers", "prefetch_factor",
                         "pin_memory", "persistent_workers", "data_dir", "eval_batch_size", "max_steps_per_epoch",
                         "device", "checkpoint_every_steps", "checkpoint_every_minutes", "spot_poll_interval_s",
                         "stop_on_rebalance", "ffcv_dir", "ffcv_os_cache")

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
ALIASES = {a: f.name for f in dataclasses.fields(TrainConfig) for a in f.metadata.get("aliases", ())}


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` to the declared type of field ``name``; raise ConfigError naming the source."""
    f = FIELDS[name]
    default = f.default if f.default is not dataclasses.MISSING else None
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if name == "precision":
            v = str(value).strip().lower()
            return _PRECISION_ALIASES.get(v, v)
        if "Optional" in typ or default is None:
            if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
                return None
            return float(value) if "float" in typ else str(value)
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise ValueError("expected true or false")
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} ({source}): got {value!r}; {e}") from None


def load_config(path: Optional[str | Path] = None, overrides: Optional[dict] = None) -> TrainConfig:
    """Build a validated config from an optional YAML file and a dict of overrides (CLI flags win).

    Args:
        path: YAML mapping of field names (or aliases such as seed 002's ``compile_model``) to values.
        overrides: field name -> value, already parsed from the command line.

    Raises:
        ConfigError: unreadable/non-mapping YAML, an unknown key (with the closest known names), or an
            invalid value (see :meth:`TrainConfig.validate`).
    """
    values: dict = {}
    if path is not None:
        p = Path(path)
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except OSError as e:
            raise ConfigError(f"config file {p}: cannot read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p}: not valid YAML ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {p}: expected a mapping of field: value, got {type(raw).__name__}")
        for key, value in raw.items():
            name = ALIASES.get(key, key)
            if name not in FIELDS:
                import difflib
                close = difflib.get_close_matches(str(key), list(FIELDS) + list(ALIASES), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ConfigError(f"{key} (in {p}): unknown config key{hint}")
            values[name] = _coerce(name, value, f"in {p}")
    for name, value in (overrides or {}).items():
        values[name] = _coerce(name, value, "command line")
    return TrainConfig(**values).validate()
