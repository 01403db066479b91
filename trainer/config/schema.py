"""The config schema's building blocks: sections, the field helper, shared constants and value spellings.

Every :class:`trainer.config.TrainConfig` field is made by :func:`config_field`, which records in the field's
metadata its section, help text, flag spelling, allowed values and YAML/flag aliases. YAML keys, command-line
flags (one argparse group per section), ``--help`` and ``docs/configuration.md`` all come from that metadata.

Pure Python: nothing here (or in the rest of :mod:`trainer.config`) imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any, Optional, Union

#: Sentinel for the embedded default dataset (scikit-learn's bundled handwritten-digit scans).
BUILTIN_DIGITS = "builtin:digits"

PRECISIONS = ("amp", "32", "bf16-mixed", "16-mixed")
#: Other spellings of :data:`PRECISIONS` (Lightning's, PyTorch's dtype names), normalised when a config is loaded.
PRECISION_ALIASES = {
    "auto": "amp",
    "mixed": "amp",
    "32-true": "32",
    "fp32": "32",
    "float32": "32",
    "bf16": "bf16-mixed",
    "bfloat16": "bf16-mixed",
    "bf16-true": "bf16-mixed",
    "16": "16-mixed",
    "fp16": "16-mixed",
    "float16": "16-mixed",
}
SCHEDULERS = ("onecycle", "cosine", "step")
OPTIMIZERS = ("sgd", "adamw")
FFCV_ORDERS = ("random", "quasi_random")
DEVICES = ("auto", "cpu", "cuda")
#: Experiment trackers of the ``tracking`` field (:mod:`trainer.engine.trackers`).
TRACKERS = ("mlflow", "wandb")
#: Where ImageFolder JPEGs are decoded (``decode_device``): in the loader workers, or on the training GPU.
DECODE_DEVICES = ("cpu", "cuda")
#: Who writes ``state.pt`` (``checkpoint_writer``): :data:`trainer.engine.checkpoint.WRITERS`, kept equal by a test.
CHECKPOINT_WRITERS = ("auto", "thread", "process")
#: Largest image side trained or evaluated on (pixels). One 8192 px RGB sample is 192 MiB as uint8 and 768 MiB as
#: float32, already beyond any GPU batch; a larger value is a typo (an extra digit), refused before anything starts.
MAX_IMAGE_SIZE = 8192

#: Section name -> one-line description, in the order ``--help`` and the docs show them. A section named like a
#: registered task (:func:`trainer.tasks.task_names`) is a *task section*: its fields only apply to that task.
SECTIONS: dict[str, str] = {
    "run": "What to train and when to stop: task, model, seed, device, epochs, target metric.",
    "data": "Where the dataset is and how it is read: folders, splits, FFCV files, image size.",
    "loader": "Batch sizes, gradient accumulation and the data-loader workers.",
    "optim": "Optimizer, learning rate schedule, gradient clipping and the weight EMA.",
    "speed": "Numeric precision and kernel options (channels_last, torch.compile, TF32).",
    "checkpoint": "Checkpoints, resuming, and stopping on spot interruption notices.",
    "logging": "Where metrics go and how often progress is printed.",
    "classification": "Task section: augmentation, loss and resolution schedule of the classification task.",
    "detection": "Task section: COCO files, DINO-4scale's architecture, denoising and the multi-scale resize.",
    "segmentation": "Task section: image/mask pairing, classes and palette, encoder, loss and the scale jitter.",
    "video": "Task section: video files or clip arrays, clip sampling, the frozen per-frame backbone and its "
    "Transformer over time, cached features.",
}

#: Section name -> the title of its ``--help`` group: what a user does there (the section name, its YAML key, follows
#: where it differs). Same keys as :data:`SECTIONS`.
SECTION_TITLES: dict[str, str] = {
    "run": "model and run length",
    "data": "data",
    "loader": "batches and loading",
    "optim": "schedule and optimizer",
    "speed": "speed",
    "checkpoint": "checkpointing and resuming",
    "logging": "logging and tracking",
    "classification": "classification",
    "detection": "detection",
    "segmentation": "segmentation",
    "video": "video",
}


def section_title(section: str) -> str:
    """``--help``'s group title of ``section``: ``schedule and optimizer (YAML section optim)``, or the name alone
    where the title is the name or none is written (a new task's section)."""
    title = SECTION_TITLES.get(section, section)
    return title if title == section else f"{title} (YAML section {section})"


#: Allowed values of a field: a tuple, or a function returning one (evaluated when used, e.g. the task registry).
Choices = Union[tuple, Callable[[], tuple]]


def task_names() -> tuple[str, ...]:
    """Registered task names (:func:`trainer.registry.task_names`)."""
    from trainer.registry import task_names as registered

    return registered()


def is_task_section(section: str) -> bool:
    """True if ``section`` is named like a registered task, i.e. its fields only apply to that task."""
    return section in task_names()


def config_field(
    section: str,
    default: Any,
    help: str,
    *,
    flag: Optional[str] = None,
    choices: Choices = (),
    aliases: tuple = (),
    legacy: Any = None,
) -> Any:
    """A dataclass field of section ``section`` with its CLI/YAML metadata.

    Args:
        section: a key of :data:`SECTIONS`.
        default: the default value (lists and dicts are copied per instance).
        help: one-line help text shown by ``--help`` and in the docs.
        flag: the flag spelling when it is not ``--`` + the name with ``-`` for ``_``.
        choices: allowed values (a tuple, or a function returning one).
        aliases: other accepted YAML keys and (hidden) flag names, e.g. seed 002's ``compile_model``.
        legacy: the value a checkpoint written before the field existed was trained with, when that is not
            ``default`` (e.g. ``pad_value``: ``black`` before the field existed); None: such checkpoints behaved as the
            default does. Read by :func:`trainer.config.fields.saved_config`.

    Raises:
        ValueError: ``section`` is not in :data:`SECTIONS` (a programming error, raised at import).
    """
    if section not in SECTIONS:
        raise ValueError(f"config_field: unknown section {section!r}; known: {', '.join(SECTIONS)}")
    meta = {"section": section, "help": help, "flag": flag, "choices": choices, "aliases": aliases, "legacy": legacy}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def choices_of(f: Any) -> tuple:
    """The allowed values of dataclass field ``f`` (empty tuple: any value of its type)."""
    choices = f.metadata.get("choices") or ()
    return tuple(choices() if callable(choices) else choices)


def section_of(f: Any) -> str:
    """The section dataclass field ``f`` belongs to."""
    return f.metadata["section"]


def flag_of(f: Any) -> str:
    """The command-line flag of dataclass field ``f`` (``batch_size`` -> ``--batch-size``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")
