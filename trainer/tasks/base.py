"""The task seam: what the task-agnostic engine needs from classification, detection, segmentation, video.

A task owns its data (datasets, collate, optionally its own loaders), its model, its **model step** (the model sees
the whole batch — inputs and targets — and returns outputs plus loss terms, so denoising-style training such as
DINO's contrastive denoising and multi-term losses fit without an engine change), its evaluator
(:mod:`trainer.engine.evaluation`) and a representative batch for planning (:meth:`Task.example_batch`). The engine
owns everything else: devices, DDP, precision, accumulation, clipping, EMA, schedules, checkpoints, logging.

Batch contract (:mod:`trainer.data.samples`): the collate function returns a dict with at least ``"bad"``;
:meth:`Task.train_batch` / :meth:`Task.eval_batch` turn it into a *device batch*: a dict holding the tensors the
model step needs and ``"n"``, the number of samples (int).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.config import TrainConfig
from trainer.engine.distributed import DistInfo
from trainer.engine.evaluation import DIRECTIONS, Evaluator
from trainer.errors import ConfigError


@dataclass
class TaskData:
    """Datasets and their description.

    ``train``/``val`` accept ``(epoch, index)`` keys; ``collate`` builds the batch dict; ``num_outputs`` is
    what the model head needs (classes); ``report`` holds log lines (census, ignored files...).

    ``label_space`` says what the model's outputs mean, as plain JSON-like values (e.g. classification:
    ``{"classes": ["ants", "bees"]}``; detection: its category names; segmentation: its class ids). The engine
    stores it in every checkpoint and refuses to resume one whose label space differs (also with
    ``force_resume``), naming the difference. Empty: the task does not describe it; nothing is checked.

    ``val_left_out``: how many val files the up-front check left out (see the field).

    ``loaders``: a format that brings its own loaders (FFCV) sets this to
    ``f(cfg, info, train, val, micro_batch, eval_batch) -> (train_loader, val_loader)``; each loader has an
    ``order`` attribute with ``set_epoch(epoch, start)`` and ``__len__`` (samples of this rank). None: the
    sampler + ``DataLoader`` path. Both behind :func:`trainer.data.loading.build_split_loaders`.
    """

    train: Dataset
    val: Dataset
    collate: Callable[[list], dict]
    num_outputs: int
    report: list[str] = field(default_factory=list)
    label_space: dict = field(default_factory=dict)
    loaders: Optional[Callable] = None
    #: val files (or pairs) named and left out before training (unreadable images, invalid masks); every epoch's
    #: ``val_bad_files`` counts them beside the files that fail during evaluation.
    val_left_out: int = 0
    #: the evaluation batches' collate when it differs from ``collate`` (e.g. detection's evaluation canvases)
    val_collate: Optional[Callable[[list], dict]] = None


@dataclass
class StepOutput:
    """What a task's model step returns for one micro-batch.

    Attributes:
        loss: scalar float32 tensor (with grad): the mean loss the engine backpropagates.
        outputs: the model's outputs (for training statistics; detached by the consumer).
        terms: name -> detached scalar tensor, the loss's parts, logged per term as ``train_<name>``
            (e.g. detection: ``loss_ce``, ``loss_bbox``, ``loss_giou``); empty when the loss is one term.
        n: samples in the micro-batch (int).
    """

    loss: torch.Tensor
    outputs: Any
    n: int
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


class Task(ABC):
    """Base class of a training task.

    ``target_metric`` (a name the evaluator reports, e.g. ``top1``) selects the ``best`` checkpoint and is the
    default metric for early stopping (config ``target_metric`` / ``target_value``); its direction comes from the
    evaluator's :attr:`~trainer.engine.evaluation.Evaluator.directions`.

    ``flops_predict_speed``: whether ``plan`` may estimate this task's images/s from its FLOPs relative to a
    ResNet-50 (true for convolutional classifiers; false where gathers, matching or host work dominate, e.g.
    DINO's deformable attention and Hungarian matching: then only a probe or ``--images-per-second`` gives time).

    ``static_input_shapes``: whether the training batches come in a few fixed shapes (a crop size, a clip length),
    so cuDNN's benchmark mode pays its per-shape autotuning once and then runs the fastest convolution algorithm
    (``torch.backends.cudnn.benchmark``, on CUDA only). False where shapes vary from batch to batch (detection's
    padded multi-scale batches), where autotuning every new shape would cost more than it saves.
    """

    name: str = "task"
    target_metric: str = "top1"
    flops_predict_speed: bool = True
    static_input_shapes: bool = True
    #: File extensions ``predict`` reads from its input folder (None: the image extensions).
    input_extensions: Optional[tuple[str, ...]] = None
    #: the files ``render_predictions`` writes per input, as suffixes of the stem of its ``out_names`` entry
    output_suffixes: tuple[str, ...] = ("",)

    def __init__(self, cfg: TrainConfig, dist: DistInfo):
        self.cfg, self.dist = cfg, dist

    # .. before any data is read ..........................................................................
    def check_config(self) -> None:
        """Raise ``ConfigError`` for a config this task cannot train, before any data is read (e.g. a model
        that needs a fixed input size). The default checks the early-stopping target (:meth:`check_target`)."""
        self.check_target()

    def check_target(self) -> tuple[str, str]:
        """The early-stopping metric and its direction: ``(name, "max" | "min")``.

        Raises:
            ConfigError: ``target_metric`` is not a metric of this task's evaluator (the known names listed).
        """
        name = (self.cfg.target_metric or self.target_metric).removeprefix("val_")
        directions = self.metric_directions()
        if name not in directions:
            raise ConfigError(
                f"target_metric: got {self.cfg.target_metric!r}; task {self.name} reports "
                f"{', '.join(sorted(directions))}"
            )
        direction = directions[name]
        if direction not in DIRECTIONS:
            raise ValueError(f"task {self.name}: metric {name} has direction {direction!r}, not one of {DIRECTIONS}")
        return name, direction

    def metric_directions(self) -> dict[str, str]:
        """Validation metric name -> "max" | "min" (the evaluator's, without building data)."""
        return dict(self.evaluator_class().directions)

    # .. data and model ....................................................................................
    @abstractmethod
    def build_data(self) -> TaskData:
        """Scan/prepare the data. Raises ``DataError`` before training starts when it is unusable."""

    @abstractmethod
    def build_model(self, num_outputs: int) -> nn.Module:
        """Create the model on CPU with freshly initialised (seeded) weights."""

    def compile_model(self, model: nn.Module) -> None:
        """``torch.compile`` the model in place (``compile: true``); state_dict keys stay unchanged. Default: the
        whole module. A task whose model has a part that compiles badly as a whole (data-dependent host code,
        shapes that change every batch) compiles its repeated blocks instead."""
        model.compile()

    def lr_scales(self) -> dict[str, float]:
        """Per-module learning-rate multipliers: parameter-name prefix -> factor of ``lr`` (e.g. DINO's backbone at
        0.1 x lr). Default: none (every parameter at ``lr``)."""
        return {}

    def epoch_fields(self, epoch: int) -> dict:
        """Extra fields of epoch ``epoch``'s (0-based) metrics row (e.g. the training image size)."""
        return {}

    # .. one step ..........................................................................................
    @abstractmethod
    def train_batch(self, batch: dict) -> dict:
        """Move a collated training batch to the device and augment it: a device batch with ``"n"``."""

    @abstractmethod
    def eval_batch(self, batch: dict) -> dict:
        """Like :meth:`train_batch` for evaluation (no augmentation); ``"n"`` may be 0 (all files bad)."""

    @abstractmethod
    def model_step(self, model: nn.Module, batch: dict) -> StepOutput:
        """Forward a device batch through ``model`` (raw, compiled or DDP-wrapped) and compute the loss terms.
        Runs inside the engine's autocast; the engine scales, backpropagates and steps."""

    @abstractmethod
    def predict(self, model: nn.Module, batch: dict) -> Any:
        """Evaluation forward of a device batch (inside ``no_grad`` and autocast): what the evaluator takes."""

    @classmethod
    @abstractmethod
    def evaluator_class(cls) -> type[Evaluator]:
        """The :class:`~trainer.engine.evaluation.Evaluator` subclass of this task."""

    def evaluator(self) -> Evaluator:
        """A fresh evaluator for this rank (default: ``evaluator_class()(device)``)."""
        return self.evaluator_class()(self.dist.device)

    def train_statistics(self, out: StepOutput, batch: dict) -> Optional[torch.Tensor]:
        """Optional float64 vector of training statistics of one micro-batch (summed over the epoch and ranks)."""
        return None

    def train_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """Named training metrics from the summed :meth:`train_statistics` (besides the loss)."""
        return {}

    # .. planning ..........................................................................................
    def input_size(self, train: bool = True) -> tuple[int, int]:
        """(H, W) in pixels of the largest sample a training (``train``) or evaluation step sees: what
        :meth:`example_batch` builds by default and what ``plan`` prices (memory, loader RAM, FLOPs). Default
        ``(image_size, image_size)``; tasks with other shapes override it."""
        return self.cfg.image_size, self.cfg.image_size

    def loader_sample_bytes(self, train: bool = True) -> int:
        """Host bytes of one sample in the loader's batch format, what each prefetched batch holds per sample
        (``plan``'s loader RAM). Default: uint8 3 x H x W at :meth:`input_size`; tasks with other inputs
        override it (video: T x 3 x S x S)."""
        h, w = self.input_size(train)
        return 3 * h * w

    def host_data_bytes(self, data: Optional[TaskData], num_samples: Optional[int] = None) -> tuple[int, int]:
        """Host RAM the dataset itself takes, in bytes: ``(per_process, per_host)``. ``per_process``: what every
        training process holds privately (e.g. arrays decompressed from a ``.npz``); ``per_host``: what all
        processes of a host share through the page cache (memory-mapped files, counted once). ``data``: the built
        :class:`TaskData`, or None when the planner did not scan the data; then a task may estimate from
        ``num_samples`` (``plan --dataset-size``) and its config. Default ``(0, 0)``: files are read per sample."""
        return 0, 0

    @abstractmethod
    def example_batch(
        self, batch_size: int, *, image_size: Optional[int] = None, num_outputs: int = 1000, train: bool = True
    ) -> dict:
        """A representative device batch of ``batch_size`` samples, as :meth:`train_batch` (``train``) or
        :meth:`eval_batch` returns it, without reading data: what the probe, the memory prediction and ``plan``
        run the real step on (images (B, 3, H, W), clips (B, T, C, H, W), images with boxes...).
        ``image_size``: side in pixels (default: the config's); ``num_outputs``: classes of the head."""

    # .. prediction (python -m trainer predict) .............................................................
    def predict_inputs(self, paths: list[str], *, first_index: int = 0) -> dict:
        """Decode image files ``paths`` and prepare them as in evaluation (the task's eval transform, collate,
        :meth:`eval_batch`): the device batch :meth:`predict` takes, plus ``"paths"`` (the files decoded, in the
        batch's row order), ``"bad"`` (a :class:`~trainer.data.samples.BadSample` per file that could not be
        decoded: left out, never raised) and what :meth:`render_predictions` needs to map outputs back to the
        files (e.g. the decoded originals, their sizes). ``first_index``: position of ``paths[0]`` among all
        inputs (tasks that number images use ``first_index + i``). ``"n"`` may be 0 (no file readable)."""
        raise NotImplementedError(f"task {self.name} does not implement predict_inputs (no prediction support)")

    def render_predictions(
        self,
        paths: list[str],
        batch: dict,
        outputs: Any,
        label_space: dict,
        out_dir: str,
        score_threshold: float,
        *,
        out_names: Optional[list[str]] = None,
    ) -> list[dict]:
        """Draw :meth:`predict`'s ``outputs`` for the batch from :meth:`predict_inputs` (``paths`` = its
        ``"paths"``): write one PNG per input into ``out_dir`` (file names ``out_names``, default
        ``<stem>.png``) and return JSON-able records (what ``predictions.json`` lists); ``label_space`` is the
        checkpoint's, ``score_threshold`` the lowest score kept where outputs are scored. ``OSError`` when a
        file cannot be written."""
        raise NotImplementedError(f"task {self.name} does not implement render_predictions (no prediction support)")

    # .. export (python -m trainer export) ..................................................................
    #: Input tensor names of the exported graph, in :meth:`export_example` order.
    export_input_names: tuple[str, ...] = ("image",)
    #: Output tensor names of :meth:`export_module`'s forward, in order.
    export_output_names: tuple[str, ...] = ("logits",)

    def export_unsupported(self, fmt: str) -> Optional[str]:
        """Why ``fmt`` (``onnx`` | ``torchscript`` | ``safetensors``) cannot be exported for this task (one phrase),
        or None when it can. Default: every format."""
        return None

    def export_sample_dirs(self, root: Path) -> list[Path]:
        """Folders whose files verify an export, most specific first (``root``: the resolved ``data_dir``).
        Default: its ``val``, ``images``, then ``root`` itself."""
        return [root / "val", root / "images", root]

    def export_module(self, model: nn.Module) -> nn.Module:
        """``model`` (eval mode, float32, CPU) wrapped with the pre/post-processing that belongs in a served graph:
        inputs are RGB pixel values float32 in [0, 255] (:meth:`export_example`), ImageNet normalisation
        (:data:`~trainer.data.transforms.IMAGENET_MEAN`/``STD``) happens inside; outputs are
        :attr:`export_output_names`. Default: normalise, then the model's logits."""
        return ExportWrapper(model, lambda logits: (logits,))

    def export_example(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Example graph inputs for ``batch_size`` samples, without reading data: float32 (B, 3, S, S) pixel values
        in [0, 255] at the config's ``image_size`` (seeded, so exports are reproducible)."""
        g = torch.Generator().manual_seed(0)
        s = self.cfg.image_size
        return (torch.randint(0, 256, (batch_size, 3, s, s), generator=g).float(),)

    #: Axes of the exported graph's inputs that take any size (:meth:`export_dynamic_shapes`), as the model card
    #: and the metadata (``dynamic_axes``) name them.
    export_dynamic_axes: tuple[str, ...] = ("batch",)

    def export_dynamic_shapes(self) -> tuple[dict, ...]:
        """``torch.export`` dynamic shapes of :meth:`export_example`'s inputs, one dict per input (axis ->
        ``torch.export.Dim``). Default: a dynamic batch axis (1 to 1,024) on every input."""
        batch = torch.export.Dim("batch", min=1, max=1024)
        return tuple({0: batch} for _ in self.export_input_names)

    def export_inputs(self, batch: dict) -> tuple[torch.Tensor, ...]:
        """Graph inputs (float32 pixel values in [0, 255], on CPU) of a device batch from :meth:`predict_inputs`:
        its normalised images mapped back through the ImageNet mean/std. Default: ``batch["image"]``."""
        return (denormalize(batch["image"]),)

    def export_verification(self, model: nn.Module, module: nn.Module, batch: dict, fmt: str) -> tuple[list, list, str]:
        """What an export is verified against, on a :meth:`predict_inputs` batch: ``(runs, reference, how)``.
        ``runs``: graph input tuples (:meth:`export_inputs`), each run through the export; ``reference``: numpy
        arrays in :attr:`export_output_names` order, the runs' outputs concatenated along the batch axis; ``how``:
        a phrase for the report. Default: one run of the whole batch, against ``module`` (the PyTorch graph
        before export) on the same inputs. ``model`` is the task's model (eval, float32, CPU); ``fmt`` ``onnx`` or
        ``torchscript``."""
        inputs = self.export_inputs(batch)
        with torch.no_grad():
            return [inputs], [o.numpy() for o in module(*inputs)], ""

    def export_metadata(self, label_space: dict, fmt: str = "onnx") -> dict:
        """Serving facts of an export (JSON-able): classes and ids from the checkpoint's ``label_space``, input
        layout and size, mean/std, and the task's post-processing parameters; ``fmt`` the export's format (a graph
        traced at a fixed size says so). Subclasses add to the default."""
        from trainer.data.transforms import IMAGENET_MEAN, IMAGENET_STD

        classes = list(label_space.get("classes") or label_space.get("categories") or [])
        return {
            "task": self.name,
            "model": self.cfg.model,
            "classes": classes,
            "class_ids": list(label_space.get("category_ids") or range(len(classes))),
            "inputs": list(self.export_input_names),
            "outputs": list(self.export_output_names),
            "input_layout": "B,3,H,W RGB float32 pixel values in [0, 255]",
            "input_size": [self.cfg.image_size, self.cfg.image_size],
            "dynamic_axes": list(self.export_dynamic_axes),
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
            "normalization": "in the graph: (x / 255 - mean) / std",
        }

    def export_agreement(self, reference: list, exported: list) -> str:
        """How far the exported model's outputs agree with PyTorch's on the same inputs, as one phrase (e.g.
        ``top-1 agreement 100.0 % (4/4)``). ``reference``/``exported``: numpy arrays in
        :attr:`export_output_names` order. Default: top-1 agreement of the first output (B, C)."""
        a, b = reference[0].argmax(1), exported[0].argmax(1)
        return f"top-1 agreement {100.0 * float((a == b).mean()):.1f} % ({int((a == b).sum())}/{len(a)})"

    def backbone_license(self) -> str:
        """The license of the pretrained weights this task's model starts from, honestly ('unknown' where the
        trainer cannot know). Default: torchvision's ImageNet weights."""
        return (
            "torchvision model code BSD-3-Clause; pretrained ImageNet weights (if the run started from them) per "
            "torchvision's model documentation (https://pytorch.org/vision/stable/models.html); this checkpoint's "
            "own weights: those of whoever trained it"
        )


def denormalize(images: torch.Tensor) -> torch.Tensor:
    """ImageNet-normalised float images (B, 3, H, W) -> float32 pixel values in [0, 255] on CPU (the inverse of
    :func:`~trainer.data.transforms.normalize_on_device`)."""
    from trainer.data.transforms import pixel_mean_std

    mean, std = pixel_mean_std()
    return images.detach().float().cpu().mul(std).add(mean).contiguous()


class ExportWrapper(nn.Module):
    """``model`` behind ImageNet normalisation of float32 pixel values in [0, 255], then ``post(logits)``, a
    function returning the tuple of outputs. Images (B, 3, H, W) or clips (B, T, 3, H, W) (the channel axis third
    from last)."""

    def __init__(self, model: nn.Module, post: Callable[[torch.Tensor], tuple]):
        super().__init__()
        from trainer.data.transforms import pixel_mean_std

        self.model, self.post = model, post
        mean, std = pixel_mean_std()
        self.register_buffer("mean", mean, persistent=False)
        self.register_buffer("inv_std", 1.0 / std, persistent=False)

    def forward(self, x: torch.Tensor):
        """``x`` float32 pixel values -> the outputs ``post`` returns."""
        return self.post(self.model((x - self.mean) * self.inv_std))
