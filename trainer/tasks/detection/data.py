"""The data half of the detection task: both COCO splits scanned, validated and relabelled, their datasets with
DINO's multi-scale training resize and crop, and the fixed canvases batches are padded to. :class:`DetectionData`
is mixed into :class:`~trainer.tasks.detection.task.DetectionTask`, which holds the model, step and evaluation
half; it is separate because reading and checking the data shares nothing with DINO's model but the config."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from trainer.errors import ConfigError, DataError
from trainer.tasks.base import TaskData
from trainer.tasks.detection.settings import check_metric_keys

#: The crop branch of DINO's training resize, as fractions of the largest training scale (upstream at 800:
#: resize to 400/500/600, then a random crop of 384..600), so small CPU runs keep the recipe's proportions.
CROP_RESIZE_FRACTIONS = (0.5, 0.625, 0.75)
CROP_SIZE_FRACTIONS = (0.48, 0.75)


def training_scales(min_scale: int, max_scale: int, step: int) -> tuple[int, ...]:
    """Shortest-side choices ``min_scale, min_scale + step, ..., max_scale`` (DINO: 480..800 step 32)."""
    return tuple(range(min_scale, max_scale + 1, step)) or (max_scale,)


class DetectionData:
    """:class:`~trainer.tasks.base.Task`'s ``build_data`` for COCO-format detection, with ``split_paths``. Expects
    the task's ``cfg`` (a validated :class:`~trainer.config.TrainConfig` with task detection), ``dist`` (local
    rank, world size) and ``canvas_setting`` (:class:`~trainer.tasks.detection.settings.DetectionSettings`); sets
    ``val_split`` and ``num_classes``."""

    def split_paths(self, split: str) -> tuple[Path, Path]:
        """(annotations JSON, image folder) of ``split`` under ``data_dir`` (``coco_annotations``/``coco_images``
        with ``{split}`` filled in)."""
        root = Path(self.cfg.data_dir)
        return (root / self.cfg.coco_annotations.format(split=split), root / self.cfg.coco_images.format(split=split))

    def build_data(self) -> TaskData:
        """Scan and validate both splits (trainer/data/formats/coco.py's policy), check the val images up front.

        Each annotations file is parsed once per node (:func:`~trainer.data.formats.coco_cache.once_per_node`)
        into the cache folder ``$TRAINSTACK_CACHE_DIR`` or ``<checkpoint_dir>/../annotation-cache`` (the temp
        folder when that is not writable); the other local ranks, and later runs, map it.

        Labels are in the config's ``label_space`` (:func:`~trainer.data.formats.coco.apply_label_space`); the
        label space stored in checkpoints is :meth:`~trainer.data.formats.coco.LabelMap.to_label_space`
        (``{"categories": names, "category_ids": JSON ids}``, plus ``label_space``/``num_classes`` for coco_ids).

        Raises:
            DataError: unusable data, or train and val with different categories.
            ConfigError: ``num_queries`` below the most boxes in one training image (the matcher would fail
                mid-training on that image); not checked when ``train_split`` is ``val_split`` (``evaluate`` reads
                the evaluated split as both, and evaluation matches nothing).
        """
        import torch.distributed as tdist

        from trainer.data.formats.coco import apply_label_space, check_coco_files, scan_coco
        from trainer.data.formats.coco_cache import default_cache_dir, once_per_node, writable_cache_dir
        from trainer.data.formats.coco_dataset import (
            CocoDetectionDataset,
            collate_detection,
            eval_transform_for_epoch,
            train_transform_for_epoch,
        )

        cfg = self.cfg
        if not Path(cfg.data_dir).is_dir():
            raise DataError(
                f"data_dir: {cfg.data_dir} is not a folder (expected {cfg.coco_annotations} and "
                f"{cfg.coco_images} under it, with {{split}} = {cfg.train_split} / {cfg.val_split})"
            )
        # parsed once per node: local rank 0 fills the annotation cache, the other local ranks map it
        cache = writable_cache_dir(default_cache_dir(cfg.checkpoint_dir))
        barrier = tdist.barrier if tdist.is_available() and tdist.is_initialized() else None

        def scan(name: str):
            paths = self.split_paths(name)
            return once_per_node(
                lambda: scan_coco(*paths, name, cfg.max_bad_fraction, cache_dir=cache), self.dist.local_rank, barrier
            )

        train, val = scan(cfg.train_split), scan(cfg.val_split)

        def relabel(split):
            try:
                return apply_label_space(split, cfg.label_space, cfg.max_category_id)
            except ValueError as e:
                raise DataError(f"{split.annotations}: {e}") from None

        train, val = relabel(train), relabel(val)
        if (train.categories, train.label_to_category_id) != (val.categories, val.label_to_category_id):
            raise DataError(
                f"data: the categories of {train.annotations} and {val.annotations} differ "
                f"({list(zip(train.label_to_category_id, train.categories))} vs "
                f"{list(zip(val.label_to_category_id, val.categories))}); both splits need the same"
            )
        counts = np.diff(train.box_start)
        evaluated_only = cfg.train_split == cfg.val_split  # python -m trainer evaluate: nothing is matched
        if len(counts) and int(counts.max()) > cfg.num_queries and not evaluated_only:
            i = int(counts.argmax())
            raise ConfigError(
                f"num_queries: {cfg.num_queries} queries, but image {train.image_ids[i]} ({train.paths[i]}) of "
                f"{train.annotations} has {int(counts[i])} boxes; one-to-one matching needs num_queries >= the "
                f"most boxes in one image (raise num_queries to at least {int(counts.max())})"
            )
        check_metric_keys(train)
        for split, why in (
            (train, "nothing to learn from"),
            (val, "COCO mAP is undefined without ground truth (it would read 0.0 and pick a 'best')"),
        ):
            if not len(split.boxes):
                raise DataError(
                    f"{split.annotations}: split {split.name} has no non-crowd box ({split.census()}); {why}; "
                    "expected annotations with iscrowd 0"
                )
        n_val = len(val.paths)
        val, val_report = check_coco_files(val, cfg.max_bad_fraction)
        self.val_split = val
        self.num_classes = train.label_map.num_classes
        scales = training_scales(cfg.min_scale, cfg.max_scale, cfg.scale_step)
        crop_resize = tuple(max(1, round(f * cfg.max_scale)) for f in CROP_RESIZE_FRACTIONS)
        crop = tuple(max(1, round(f * cfg.max_scale)) for f in CROP_SIZE_FRACTIONS)
        report = [
            f"data: {cfg.data_dir}",
            f"data: {cfg.train_split}: {train.census()}",
            f"data: {cfg.val_split}: {val.census()}",
            *train.report,
            *val.report,
            *val_report,
        ]
        train_ds = CocoDetectionDataset(
            train,
            train_transform_for_epoch(scales, cfg.max_size, crop_resize, crop, cfg.hflip_prob, cfg.crop_prob),
            seed=cfg.seed,
        )
        val_ds = CocoDetectionDataset(
            val, eval_transform_for_epoch(cfg.eval_size, cfg.max_size), seed=cfg.seed, replace_bad=False
        )
        train_canvases, eval_canvases, canvas_report = self._canvases(train_ds, val_ds, (scales, crop, cfg.crop_prob))
        report += canvas_report
        return TaskData(
            train_ds,
            val_ds,
            functools.partial(
                collate_detection, pad_to_multiple=cfg.pad_to_multiple, canvases=train_canvases, pad_value=cfg.pad_value
            ),
            self.num_classes,
            report,
            label_space=train.label_map.to_label_space(),
            val_left_out=n_val - len(val.paths),
            val_collate=functools.partial(
                collate_detection, pad_to_multiple=cfg.pad_to_multiple, canvases=eval_canvases, pad_value=cfg.pad_value
            ),
        )

    def _canvases(self, train_ds, val_ds, train_recipe: tuple) -> tuple[list, list, list[str]]:
        """(training canvases, evaluation canvases, report lines) for ``canvases``
        (:func:`~trainer.data.formats.canvases.choose_canvases`); ``train_recipe``: (scales, crop_size, crop_prob).

        Raises:
            ConfigError: a list none of whose canvases holds the cover (naming the size it needs).
        """
        from trainer.data.formats.canvases import choose_canvases

        cfg = self.cfg
        setting = self.canvas_setting()
        if not setting:
            return [], [], []
        micro = cfg.micro_batch_size(self.dist.world_size)
        try:
            train_c, eval_c = choose_canvases(
                setting, train_ds, val_ds, train_recipe, cfg.max_size, cfg.pad_to_multiple, micro,
                cfg.eval_batch_size or 2 * micro, cfg.seed,
            )  # fmt: skip
        except ValueError as e:
            raise ConfigError(f"canvases: got {cfg.canvases!r}; {e}") from None
        fmt = ", ".join
        line = (
            f"data: canvases ({cfg.canvases}): training {fmt(f'{h}x{w}' for h, w in train_c)}; evaluation "
            f"{fmt(f'{h}x{w}' for h, w in eval_c)}"
        )
        return train_c, eval_c, [line]
