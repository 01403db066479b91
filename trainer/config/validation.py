"""Value checks of a :class:`~trainer.config.TrainConfig`: each error names the field and what is allowed."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Optional

from trainer.config.schema import BUILTIN_DIGITS, MAX_IMAGE_SIZE, TRACKERS, choices_of, is_task_section, section_of
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config.fields import TrainConfig


def task_section_conflict(f: dataclasses.Field, value: object, task: str) -> Optional[str]:
    """Why config field ``f`` (a :class:`~trainer.config.TrainConfig` dataclass field) may not have ``value``
    under ``task`` (one phrase), or None if it may.

    A field of a task section (a section named like a registered task) may differ from its default only
    while ``task`` is that task. Returns None when ``task`` itself is not registered (its own check reports it).
    """
    from trainer.config.schema import task_names

    name = f.name
    section = section_of(f)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if section == task or not is_task_section(section) or task not in task_names() or value == default:
        return None
    return (
        f"{name} belongs to task section {section} and only applies with task: {section}, but task is "
        f"{task}; remove it or set it to its default ({default!r})"
    )


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every field of ``cfg``; return ``cfg`` unchanged.

    Raises:
        ConfigError: the first bad field, as ``name: got VALUE; what is allowed`` (one line).
    """
    for f in dataclasses.fields(cfg):
        choices = choices_of(f)
        value = getattr(cfg, f.name)
        if choices and value not in choices:
            raise ConfigError(f"{f.name}: got {value!r}; allowed: {', '.join(map(str, choices))}")
    for f in dataclasses.fields(cfg):
        why = task_section_conflict(f, getattr(cfg, f.name), cfg.task)
        if why:
            raise ConfigError(f"{f.name}: got {getattr(cfg, f.name)!r}; {why}")
    if cfg.decode_device == "cuda" and (cfg.use_ffcv or cfg.task != "classification"):
        what = "use_ffcv (FFCV decodes in its own pipeline)" if cfg.use_ffcv else f"task {cfg.task}"
        raise ConfigError(
            f"decode_device: got 'cuda' with {what}; expected cpu: GPU decoding is implemented for "
            "classification's ImageFolder data only"
        )
    for name in cfg.tracking:
        if name not in TRACKERS:
            raise ConfigError(f"tracking: got {name!r}; allowed: {', '.join(TRACKERS)} (a list: mlflow,wandb)")
    if len(set(cfg.tracking)) != len(cfg.tracking):
        raise ConfigError(f"tracking: got {cfg.tracking!r}; name each tracker once")
    if not cfg.tracking_experiment.strip():
        raise ConfigError("tracking_experiment: empty; give an MLflow experiment / W&B project name")
    if "mlflow" in cfg.tracking:  # MLFLOW_TRACKING_URI: checked by train (engine/run.py), not by every reader
        check_mlflow_uri(cfg.tracking_uri, "tracking_uri")
    _positive = (
        "batch_size",
        "accumulate_grad_batches",
        "epochs",
        "image_size",
        "checkpoint_interval",
        "keep_last_checkpoints",
        "log_every_steps",
        "progressive_stages",
        "progressive_min_size",
        "step_size_epochs",
        "max_category_id",
    )
    for name in _positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}: got {getattr(cfg, name)!r}; must be an integer >= 1")
    for name in ("image_size", "progressive_min_size"):
        if getattr(cfg, name) > MAX_IMAGE_SIZE:
            raise ConfigError(
                f"{name}: got {getattr(cfg, name)!r}; must be <= {MAX_IMAGE_SIZE} pixels (one side of the square image)"
            )
    for name in ("num_workers", "eval_batch_size", "max_steps_per_epoch", "checkpoint_every_steps"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name}: got {getattr(cfg, name)!r}; must be an integer >= 0")
    if cfg.prefetch_factor < 1:
        raise ConfigError(f"prefetch_factor: got {cfg.prefetch_factor}; must be >= 1")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"lr: got {cfg.lr!r}; must be a finite number > 0")
    for name, lo, hi in (("label_smoothing", 0.0, 1.0), ("max_bad_fraction", 0.0, 1.0), ("ema_decay", 0.0, 1.0)):
        v = getattr(cfg, name)
        if not (lo <= v < hi):
            raise ConfigError(f"{name}: got {v!r}; must be in [{lo}, {hi})")
    for name in ("cutmix_prob", "hflip_prob", "crop_prob", "momentum"):
        v = getattr(cfg, name)
        if not (0.0 <= v <= 1.0):
            raise ConfigError(f"{name}: got {v!r}; must be in [0, 1]")
    for name in ("crop_scale_min", "val_resize_ratio"):
        v = getattr(cfg, name)
        if not (0.0 < v <= 1.0):
            raise ConfigError(f"{name}: got {v!r}; must be in (0, 1]")
    if cfg.spot_poll_interval_s <= 0:
        raise ConfigError(f"spot_poll_interval_s: got {cfg.spot_poll_interval_s}; must be > 0")
    for name in (
        "mixup_alpha",
        "cutmix_alpha",
        "weight_decay",
        "gradient_clip",
        "warmup_epochs",
        "checkpoint_every_minutes",
    ):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name}: got {getattr(cfg, name)!r}; must be >= 0")
    if cfg.warmup_epochs >= cfg.epochs:
        raise ConfigError(f"warmup_epochs: got {cfg.warmup_epochs}; must be < epochs ({cfg.epochs})")
    if not 0 < cfg.step_gamma <= 1:
        raise ConfigError(f"step_gamma: got {cfg.step_gamma}; must be in (0, 1]")
    _check_target(cfg)
    if cfg.progressive_resize and cfg.progressive_min_size > cfg.image_size:
        raise ConfigError(
            f"progressive_min_size: got {cfg.progressive_min_size}; must be <= image_size ({cfg.image_size})"
        )
    if not cfg.data_dir:
        raise ConfigError("data_dir: empty; give an ImageFolder root or " + BUILTIN_DIGITS)
    if cfg.use_ffcv and not cfg.ffcv_dir:
        raise ConfigError(
            "ffcv_dir: required with use_ffcv (the folder holding "
            f"{cfg.train_split}.ffcv and {cfg.val_split}.ffcv; see python -m trainer write-ffcv)"
        )
    return cfg


def _check_target(cfg: TrainConfig) -> None:
    """``target_value`` finite; ``target_metric`` a non-empty name without spaces. Whether the metric exists
    and which range its value may take is the task's to check (it knows what its evaluator reports)."""
    v = cfg.target_value
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
        raise ConfigError(f"target_value: got {v!r}; must be a finite number")
    m = cfg.target_metric
    if m is not None and (not isinstance(m, str) or not m.strip() or any(c.isspace() for c in m)):
        raise ConfigError(f"target_metric: got {m!r}; must be a metric name without spaces, e.g. top1")


#: MLflow tracking-store schemes that need SQLAlchemy (``mlflow/store/db/db_types.py`` ``DATABASE_ENGINES``).
_SQL_SCHEMES = ("postgresql", "mysql", "sqlite", "mssql")


def mlflow_uri_schemes() -> list[str]:
    """The tracking-URI schemes this install's MLflow opens, as MLflow registers them
    (``mlflow/tracking/_tracking_service/utils.py`` ``_register_tracking_stores``, MLflow 3.x): ``file`` (and a
    plain path), ``databricks``, ``databricks-uc``, ``uc``, ``http``, ``https``; the SQL engines only when
    SQLAlchemy is installed (mlflow-skinny, which requirements-trainer.txt pins, does not ship it); and the
    schemes of installed store plugins (the ``mlflow.tracking_store`` entry points: ``arn`` from sagemaker-mlflow).
    Found without importing MLflow."""
    import importlib.util
    from importlib.metadata import entry_points

    schemes = ["file", "http", "https", "databricks", "databricks-uc", "uc"]
    if importlib.util.find_spec("sqlalchemy") is not None:
        schemes += list(_SQL_SCHEMES)
    schemes += [e.name for e in entry_points(group="mlflow.tracking_store")]
    return schemes


def check_mlflow_uri(uri: Optional[str], name: str) -> None:
    """Refuse an MLflow tracking URI this install cannot open (``ftp:``, or ``sqlite:`` without SQLAlchemy), which
    MLflow would otherwise accept and then fail on at the first call, tracking nothing.

    Raises:
        ConfigError: ``name: got URI: ...``, naming the schemes that work (:func:`mlflow_uri_schemes`)."""
    if not uri:
        return
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme
    if not scheme or (len(scheme) == 1 and os.name == "nt"):
        return  # a local path: a file store
    schemes = mlflow_uri_schemes()
    if scheme in schemes:
        return
    why = " needs SQLAlchemy, which this install lacks (mlflow-skinny);" if scheme in _SQL_SCHEMES else ""
    raise ConfigError(
        f"{name}: got {uri!r}: scheme {scheme}:{why} this install's MLflow opens a path or "
        f"{', '.join(s + ':' for s in schemes)}; give one of those (e.g. file:/path/mlruns)"
    )
