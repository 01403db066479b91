"""The config half of the detection task: the checks made before any data is read (one ``ConfigError`` line
naming the field) and the settings derived from the config (the canvases setting, the matcher's solver, the
:class:`~trainer.models.dino.DinoConfig`). :class:`DetectionSettings` is mixed into
:class:`~trainer.tasks.detection.task.DetectionTask`, which holds the training and evaluation half; plus the two
checks it makes of the machine and the data (:func:`compile_unavailable`, :func:`check_metric_keys`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from trainer.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch


class DetectionSettings:
    """:class:`~trainer.tasks.base.Task`'s ``check_config`` for DINO and the settings it derives. Expects the task's
    ``cfg`` (a validated :class:`~trainer.config.TrainConfig` with task detection) and ``dist`` (device, world
    size, rank)."""

    # .. config ............................................................................................
    def check_config(self) -> None:
        """Before any data is read: the backbone name, positive sizes, the target metric.

        Raises:
            ConfigError: naming the field.
        """
        from trainer.models.dino.config import BACKBONES

        cfg = self.cfg
        if cfg.model not in BACKBONES:
            raise ConfigError(
                f"model: got {cfg.model!r}; detection (DINO-4scale) takes a ResNet backbone: " + ", ".join(BACKBONES)
            )
        for name in (
            "min_scale",
            "max_scale",
            "scale_step",
            "max_size",
            "eval_size",
            "pad_to_multiple",
            "num_queries",
            "num_select",
            "hidden_dim",
            "dim_feedforward",
            "nheads",
            "enc_layers",
            "dec_layers",
            "enc_n_points",
            "dec_n_points",
        ):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"{name}: got {getattr(cfg, name)}; must be an integer >= 1")
        if cfg.min_scale > cfg.max_scale:
            raise ConfigError(f"min_scale: got {cfg.min_scale}; must be <= max_scale ({cfg.max_scale})")
        if cfg.hidden_dim % cfg.nheads or cfg.hidden_dim % 32:
            raise ConfigError(
                f"hidden_dim: got {cfg.hidden_dim}; must be divisible by nheads ({cfg.nheads}) and by 32 "
                "(GroupNorm(32, hidden_dim) in DINO's input projection)"
            )
        self._check_encoder_tokens()
        self.canvas_setting()
        if cfg.dn_number < 0 or not 0 <= cfg.dn_label_noise_ratio <= 1 or cfg.dn_box_noise_scale < 0:
            raise ConfigError(
                "dn_number must be >= 0, dn_label_noise_ratio in [0, 1], dn_box_noise_scale >= 0; got "
                f"{cfg.dn_number}, {cfg.dn_label_noise_ratio}, {cfg.dn_box_noise_scale}"
            )
        if cfg.dn_max_boxes < 0:
            raise ConfigError(f"dn_max_boxes: got {cfg.dn_max_boxes}; must be >= 0 (0 = sized per batch)")
        self.matcher_solver()
        self._check_cuda_graphs()
        if not 0 <= cfg.backbone_lr_scale <= 1:
            raise ConfigError(f"backbone_lr_scale: got {cfg.backbone_lr_scale}; must be in [0, 1]")
        if cfg.pretrained_backbone and not Path(cfg.pretrained_backbone).is_file():
            raise ConfigError(
                f"pretrained_backbone: {cfg.pretrained_backbone} is not a file (a torchvision ResNet "
                "state_dict saved with torch.save)"
            )
        if cfg.init_from:
            from trainer.models.dino.weights import init_file

            try:
                init_file(cfg.init_from)
            except ValueError as e:
                raise ConfigError(f"init_from: {e}") from None
        metric, _ = self.check_target()
        if cfg.target_value is not None and not 0 < cfg.target_value <= 100:
            raise ConfigError(
                f"target_value: got {cfg.target_value}; {metric} is a percentage: give a value in (0, 100]"
            )

    def canvas_setting(self) -> list | str:
        """The ``canvases`` field parsed (:func:`~trainer.data.formats.canvases.parse_canvases`): ``[]``,
        ``"auto"`` or the (H, W) canvases.

        Raises:
            ConfigError: naming ``canvases`` and what is expected.
        """
        from trainer.data.formats.canvases import parse_canvases

        try:
            return parse_canvases(self.cfg.canvases, self.cfg.pad_to_multiple)
        except ValueError as e:
            raise ConfigError(f"canvases: got {self.cfg.canvases!r}; {e}") from None

    def _check_encoder_tokens(self) -> None:
        """Two-stage query selection takes the top ``num_queries`` of the encoder's tokens, so the smallest image
        must give at least that many (else the first step fails inside the model). The bound is a square image
        of side min(min_scale, eval_size, max_size) padded up to ``pad_to_multiple``: ceil(side / stride)^2 tokens
        per feature level (strides 8, 16, 32 and 64 for DINO-4scale). An image of extreme aspect ratio, whose
        shorter side the ``max_size`` cap pushes below that, is left to the model's own check.

        Raises:
            ConfigError: ``num_queries: ...`` naming the token count and both ways out.
        """
        cfg = self.cfg
        m = cfg.pad_to_multiple
        side = -(-min(cfg.min_scale, cfg.eval_size, cfg.max_size) // m) * m
        try:
            dino = self.dino_config()
        except ValueError as e:
            raise ConfigError(str(e).replace("DinoConfig.", "")) from None
        strides = [2 ** (i + 2) for i in dino.return_interm_indices]
        if dino.dilation:
            strides[-1] //= 2
        while len(strides) < dino.num_feature_levels:
            strides.append(strides[-1] * 2)
        tokens = sum((-(-side // st)) ** 2 for st in strides)
        if tokens < cfg.num_queries:
            raise ConfigError(
                f"num_queries: {cfg.num_queries} queries, but the smallest image ({side} x {side} px: "
                f"min(min_scale, eval_size, max_size) = {min(cfg.min_scale, cfg.eval_size, cfg.max_size)} padded to "
                f"pad_to_multiple {m}) gives only {tokens} encoder tokens to select them from; use num_queries <= "
                f"{tokens} (and num_select <= num_queries) or larger images"
            )

    def _check_cuda_graphs(self) -> None:
        """``cuda_graphs`` only where every training shape is fixed per canvas and nothing captured reads the host.

        Raises:
            ConfigError: one line naming what stands in the way (checked in this order: compile, canvases,
                dn_max_boxes, accumulate_grad_batches, more than one process, a device that is not CUDA).
        """
        cfg = self.cfg
        if not cfg.cuda_graphs:
            return
        reasons = [
            (cfg.compile, "not with compile: true (one or the other: both replace the eager kernel launches)"),
            (
                not self.canvas_setting(),
                "needs fixed canvases (canvases: auto or a list): per-batch padding makes "
                "a new shape, hence a new capture, every few batches",
            ),
            (
                cfg.dn_number > 0 and cfg.dn_max_boxes == 0,
                "needs dn_max_boxes > 0 with denoising (dn_number "
                f"{cfg.dn_number}): the denoising part's size would change with the batch's box count",
            ),
            (
                cfg.accumulate_grad_batches > 1,
                f"needs accumulate_grad_batches 1, got {cfg.accumulate_grad_batches} "
                "(a second backward replay overwrites the gradients of the first)",
            ),
            (
                self.dist.world_size > 1,
                f"runs in one process only, got {self.dist.world_size} (DDP's gradient all-reduce is not captured)",
            ),
            (self.dist.device.type != "cuda", f"needs a CUDA device, got {self.dist.device.type}"),
        ]
        for failed, why in reasons:
            if failed:
                raise ConfigError(f"cuda_graphs: {why}; train without --cuda-graphs")

    def matcher_solver(self) -> str:
        """The :class:`~trainer.models.dino.matcher.HungarianMatcher` solver of this run: ``matcher`` with ``auto``
        resolved (``batched`` on CUDA when torch-linear-assignment's Triton solver imports, else ``scipy``).

        Raises:
            ConfigError: ``batched`` cannot run here (the package, or on CUDA its Triton solver, does not import);
                a value outside scipy / batched / auto is refused by the config's choices before this.
        """
        from trainer.models.dino.matcher import batched_solver_missing

        choice, cuda = self.cfg.matcher, self.dist.device.type == "cuda"
        if choice == "scipy":
            return "scipy"
        missing = batched_solver_missing(cuda)
        if choice == "auto":
            return "batched" if cuda and missing is None else "scipy"
        if missing:
            raise ConfigError(f"matcher: batched: {missing}")
        return "batched"

    def dino_config(self):
        """The :class:`~trainer.models.dino.DinoConfig` of this run (upstream defaults, the config's overrides)."""
        from trainer.models.dino.config import DinoConfig

        cfg = self.cfg
        return DinoConfig(
            backbone=cfg.model,
            pretrained=cfg.pretrained_backbone,
            lr_backbone=cfg.lr * cfg.backbone_lr_scale,
            hidden_dim=cfg.hidden_dim,
            dim_feedforward=cfg.dim_feedforward,
            nheads=cfg.nheads,
            enc_layers=cfg.enc_layers,
            dec_layers=cfg.dec_layers,
            enc_n_points=cfg.enc_n_points,
            dec_n_points=cfg.dec_n_points,
            num_queries=cfg.num_queries,
            num_select=cfg.num_select,
            dn_number=cfg.dn_number,
            dn_box_noise_scale=cfg.dn_box_noise_scale,
            dn_label_noise_ratio=cfg.dn_label_noise_ratio,
            dn_max_boxes=cfg.dn_max_boxes,
        )


def compile_unavailable(device: torch.device) -> Optional[str]:
    """Why ``torch.compile`` (Inductor) cannot compile for ``device``, or None: CUDA needs Triton
    (``torch.utils._triton.has_triton``), the CPU a C++ compiler (``torch._inductor.config.cpp.cxx`` or ``$CXX``,
    else g++/c++ on PATH)."""
    import os
    import shutil

    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (torch.compile needs it for CUDA)"
    if device.type == "cpu":
        from torch._inductor import config

        cxx = config.cpp.cxx
        cxx = (cxx,) if isinstance(cxx, str) else tuple(cxx or ())
        candidates = [c for c in (*cxx, os.environ.get("CXX"), "g++", "c++") if c]
        if not any(shutil.which(c) for c in candidates):
            return "no C++ compiler on PATH (torch.compile needs one for the CPU; set CXX)"
    return None


def check_metric_keys(split) -> None:
    """Every category's per-class AP key (``ap_<name>``, :func:`~trainer.engine.evaluation.metric_key`) must be its
    own: two categories whose names give one key would merge their AP in the metrics (segmentation refuses the
    same for its IoU keys).

    Raises:
        DataError: naming the annotations file and the categories (JSON id and name) that share a key.
    """
    from trainer.engine.evaluation import metric_key

    by_key: dict[str, list[str]] = {}
    for cat_id, name in zip(split.label_to_category_id, split.categories):
        by_key.setdefault(f"ap_{metric_key(name)}", []).append(f"id {cat_id} {name!r}")
    clashes = [f"{' and '.join(v)} -> {k}" for k, v in by_key.items() if len(v) > 1]
    if clashes:
        raise DataError(
            f"{split.annotations}: categories share a per-class metric key ({'; '.join(clashes[:3])}); "
            "give each category its own name"
        )
