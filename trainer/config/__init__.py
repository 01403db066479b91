"""One typed training config: YAML file + command-line overrides, validated once before anything starts.

The package: :mod:`~trainer.config.schema` (sections, the field helper, constants),
:mod:`~trainer.config.fields` (:class:`TrainConfig` and its field tables), :mod:`~trainer.config.validation`
(value checks) and :mod:`~trainer.config.loading` (YAML and overrides -> :class:`TrainConfig`). Pure Python: no
torch import (``infra/`` validates job YAML with it). Reference of every field: ``docs/configuration.md``.

Every field belongs to one section (:data:`SECTIONS`: run, data, loader, optim, speed, checkpoint, logging, and
the task section classification). YAML takes flat keys (``lr: 0.1``), section mappings (``optim: {lr: 0.1}``) or
both; fields stay flat everywhere else (``cfg.lr``, :meth:`TrainConfig.to_dict`, checkpoints, flags).

The field names are the YAML keys. They include the keys of seed 002's ``configs/single_gpu_full.yaml``
(``batch_size, num_workers, prefetch_factor, pin_memory, persistent_workers, compile_model, mixup_alpha,
cutmix_alpha, label_smoothing, lr, precision``) and every flag of seed 003's training command
(``--batch-size --epochs --lr --warmup-epochs --scheduler --momentum --weight-decay --label-smoothing
--gradient-clip --cutmix-prob --mixup-alpha --progressive-resize --use-ema --amp --checkpoint-dir --log-dir
--checkpoint-interval --auto-resume/--no-auto-resume --resume --target-accuracy --num-workers``);
``compile_model`` is an alias of ``compile`` and ``target_accuracy`` of ``target_value``.

Conventions (they differ between the seeds, so they are fixed here):

* ``batch_size`` is the **global batch size**: images per optimizer step summed over all ranks and all
  accumulation micro-steps (seed 003: "--batch-size 2048 = 256 per GPU x 8 GPUs"). The per-rank
  **micro-batch** is ``batch_size / (world_size * accumulate_grad_batches)`` and must be a whole number.
* ``lr`` is the peak learning rate for that global batch; it is never rescaled automatically (seed 003:
  "the code does NOT auto-scale by world_size"). A warning names linear scaling beyond 0.1 per 256 images.
* ``precision``: ``amp`` = bf16 autocast where the device supports it, fp16 autocast + GradScaler otherwise,
  fp32 on CPU; ``32`` = fp32; ``bf16-mixed`` / ``16-mixed`` force a dtype (Lightning's names, seed 002).
* ``target_metric`` / ``target_value``: training stops early once the task's evaluator reports
  ``target_metric`` (default: the task's own target metric, classification: ``top1``) at ``target_value``;
  the task checks the metric name and the value's range.
"""

from __future__ import annotations

from trainer.config.fields import (  # noqa: F401
    ALIASES,
    FIELDS,
    FIELDS_BY_SECTION,
    NON_TRAJECTORY_FIELDS,
    TrainConfig,
    saved_config,
)
from trainer.config.loading import EMBEDDED_DEFAULT, embedded_default_for, load_config, yaml_fields  # noqa: F401
from trainer.config.schema import (  # noqa: F401
    BUILTIN_DIGITS,
    DECODE_DEVICES,
    DEVICES,
    FFCV_ORDERS,
    MAX_IMAGE_SIZE,
    OPTIMIZERS,
    PRECISION_ALIASES,
    PRECISIONS,
    SCHEDULERS,
    SECTIONS,
    choices_of,
    flag_of,
    is_task_section,
    section_of,
    section_title,
    task_names,
)
from trainer.errors import ConfigError  # noqa: F401 - re-exported

__all__ = [
    "ALIASES",
    "BUILTIN_DIGITS",
    "ConfigError",
    "DECODE_DEVICES",
    "DEVICES",
    "EMBEDDED_DEFAULT",
    "FFCV_ORDERS",
    "FIELDS",
    "FIELDS_BY_SECTION",
    "MAX_IMAGE_SIZE",
    "NON_TRAJECTORY_FIELDS",
    "saved_config",
    "OPTIMIZERS",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "SCHEDULERS",
    "SECTIONS",
    "TrainConfig",
    "choices_of",
    "embedded_default_for",
    "flag_of",
    "is_task_section",
    "load_config",
    "section_of",
    "section_title",
    "task_names",
    "yaml_fields",
]
