"""The ``video`` task: clip classification (seed 004) — video files per class folder or clip arrays
(trainer/data/formats/video), seed 004's frozen per-frame ResNet-18 + Transformer over time or a torchvision video
model (trainer/models/video.py), cross-entropy, top-1/top-5 accuracy; optionally on cached frame features."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.errors import ConfigError, DataError
from trainer.tasks.base import ExportWrapper, StepOutput, Task, TaskData, denormalize
from trainer.tasks.classification.task import TopKEvaluator, _correct, softmax_outputs

#: File extensions ``predict`` reads as videos.
VIDEO_EXTENSIONS = (".mp4", ".avi", ".webm", ".mkv", ".mov")


def _normalize_clips(clips: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 (B, T, 3, H, W) on host -> float32 on ``device``, ImageNet-normalised per frame."""
    from trainer.data.transforms import normalize_on_device

    b, t = clips.shape[:2]
    return normalize_on_device(clips.reshape(b * t, *clips.shape[2:]), device, False).reshape(clips.shape)


class VideoTask(Task):
    """Clip classification.

    Device batches: ``clip`` float32 (B, T, 3, S, S) ImageNet-normalised (from uint8 clips, which stay uint8 until
    the device), or with ``cache_features`` ``features`` float16 (B, T, D) (the frozen backbone's cached per-frame
    features); ``label`` int64 (B,); ``n`` = B. Model outputs: logits (B, classes). Metrics: top-1/top-5 (%) and
    the loss (:class:`~trainer.tasks.classification.task.TopKEvaluator`).
    """

    name = "video"
    target_metric = "top1"
    flops_predict_speed = False  # clips/s follow the decoder and the loader (seed 004), not the model's FLOPs

    # .. config ............................................................................................
    def check_config(self) -> None:
        """Before any data is read: the model name and that it takes ``num_frames`` x ``image_size`` clips, the clip
        fields, the Transformer sizes, and that ``cache_features`` is possible.

        Raises:
            ConfigError: the first problem, naming the field.
        """
        from trainer.models.video import VIDEO_MODELS, check_video_input

        cfg = self.cfg
        if cfg.model not in VIDEO_MODELS:
            raise ConfigError(f"model: got {cfg.model!r}; video models: {', '.join(VIDEO_MODELS)}")
        for name in ("num_frames", "frame_stride", "temporal_dim", "temporal_layers", "temporal_heads"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"{name}: got {getattr(cfg, name)}; must be an integer >= 1")
        if cfg.temporal_dim % cfg.temporal_heads:
            raise ConfigError(
                f"temporal_dim: got {cfg.temporal_dim}; must be a multiple of temporal_heads ({cfg.temporal_heads})"
            )
        if not 0 <= cfg.temporal_dropout < 1:
            raise ConfigError(f"temporal_dropout: got {cfg.temporal_dropout}; expected 0 <= dropout < 1")
        if cfg.cache_features:
            if cfg.model != "frame_transformer":
                raise ConfigError(
                    f"cache_features: only frame_transformer has a frozen per-frame backbone to cache; model is "
                    f"{cfg.model}"
                )
            if cfg.hflip_prob > 0:
                raise ConfigError(
                    f"cache_features: hflip_prob is {cfg.hflip_prob}; cached features need frames that no "
                    "augmentation changes: set hflip_prob: 0"
                )
        check_video_input(cfg)
        metric, _ = self.check_target()
        if cfg.target_value is not None and metric != "loss" and not 0 < cfg.target_value <= 100:
            raise ConfigError(f"target_value: got {cfg.target_value}; {metric} is a percentage: give (0, 100]")

    # .. data and model ....................................................................................
    def _frozen_backbone(self) -> nn.Module:
        """The frozen per-frame backbone as the model will hold it: ``frame_weights`` when given, else a seeded
        random init (a function of ``seed`` only, so ``build_data``'s cache and ``build_model`` agree)."""
        from trainer.models.video import build_frame_backbone

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return build_frame_backbone(self.cfg)

    def build_data(self) -> TaskData:
        """Open both splits (folders: probe every file; arrays: check ranks, dtype and labels), then the clip
        datasets; with ``cache_features`` fill or reuse the feature cache first.

        Label space in checkpoints: ``{"classes": names}``.

        Raises:
            DataError: unusable folders, files or arrays; class lists that differ between the splits.
        """
        from trainer.data.formats.video import VideoClipDataset, check_same_classes, collate_clips, open_video_split

        cfg = self.cfg
        if not Path(cfg.data_dir).exists():
            raise DataError(f"data_dir: {cfg.data_dir} does not exist (video_format {cfg.video_format})")
        train_src = open_video_split(cfg, cfg.train_split, cfg.image_size)
        val_src = open_video_split(cfg, cfg.val_split, cfg.image_size)
        check_same_classes(train_src, val_src)
        classes = list(train_src.classes)
        if len(classes) < 2:
            raise DataError(f"data_dir: {cfg.data_dir} has {len(classes)} class; video classification needs >= 2")
        report = [f"data: {cfg.data_dir} ({cfg.video_format}): {len(classes)} classes"]
        report += list(getattr(train_src, "report", [])) + list(getattr(val_src, "report", []))
        report.append(f"data: {cfg.train_split}: {len(train_src)} clips; {cfg.val_split}: {len(val_src)} clips")
        self.sources = {"train": train_src, "val": val_src}
        if cfg.short_clips == "reject":
            for split, src in ((cfg.train_split, train_src), (cfg.val_split, val_src)):
                report += _check_rejected_clips(src, split, classes, cfg)
        if cfg.cache_features:
            train_src, val_src = self._cached(train_src, val_src, report)
        common = dict(num_frames=cfg.num_frames, stride=cfg.frame_stride, seed=cfg.seed, short_clips=cfg.short_clips)
        train = VideoClipDataset(
            train_src, mode=cfg.temporal_crop, hflip_prob=cfg.hflip_prob, replace_bad=True, **common
        )
        val = VideoClipDataset(val_src, mode="uniform", hflip_prob=0.0, replace_bad=False, **common)
        self.feature_sources = {"train": train_src, "val": val_src} if cfg.cache_features else None
        return TaskData(train, val, collate_clips, len(classes), report, label_space={"classes": classes})

    def _cached(self, train_src, val_src, report: list[str]):
        import torch.distributed as tdist

        from trainer.tasks.video.features import default_cache_dir, open_cached

        cfg, dist = self.cfg, self.dist
        backbone = self._frozen_backbone()
        folder = default_cache_dir(cfg.checkpoint_dir, cfg.feature_cache_dir)
        barrier = tdist.barrier if tdist.is_available() and tdist.is_initialized() else None
        out = []
        for src in (train_src, val_src):
            feats, line = open_cached(
                src,
                backbone,
                folder,
                cfg.image_size,
                backbone.feature_dim,
                dist.device,
                dist.rank,
                dist.world_size,
                barrier,
                log=lambda m: None,
            )
            report.append(line)
            out.append(feats)
        return out

    def build_model(self, num_outputs: int) -> nn.Module:
        """The configured video model with ``num_outputs`` classes; frame_transformer holds :meth:`_frozen_backbone`
        (the weights the feature cache was filled with).

        Raises:
            ConfigError: unknown model, unusable ``frame_weights``.
        """
        from trainer.models.video import build_video_model

        backbone = self._frozen_backbone() if self.cfg.model == "frame_transformer" else None
        return build_video_model(self.cfg, num_outputs, backbone=backbone)

    # .. one step ..........................................................................................
    def _device_batch(self, batch: dict) -> dict:
        dev = self.dist.device
        label = batch["label"].to(dev, non_blocking=True)
        if "features" in batch:
            return {"features": batch["features"].to(dev, non_blocking=True), "label": label, "n": label.shape[0]}
        return {"clip": _normalize_clips(batch["clip"], dev), "label": label, "n": label.shape[0]}

    def train_batch(self, batch: dict) -> dict:
        """The collated batch on the device (clip sampling and flips ran in the loader workers)."""
        return self._device_batch(batch)

    def eval_batch(self, batch: dict) -> dict:
        return self._device_batch(batch)

    @staticmethod
    def _inputs(batch: dict) -> torch.Tensor:
        return batch["features"] if "features" in batch else batch["clip"]

    def model_step(self, model: nn.Module, batch: dict) -> StepOutput:
        """Logits (B, classes) of the clips (or cached features) and their cross-entropy (float32 mean)."""
        out = model(self._inputs(batch))
        return StepOutput(loss=F.cross_entropy(out.float(), batch["label"]), outputs=out, n=batch["n"])

    def predict(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """Logits (B, classes)."""
        return model(self._inputs(batch))

    @classmethod
    def evaluator_class(cls):
        return TopKEvaluator

    def train_statistics(self, out: StepOutput, batch: dict) -> torch.Tensor:
        """float64 [top-1 correct, count] of one micro-batch."""
        top1, _ = _correct(out.outputs.detach(), batch["label"])
        n = torch.full((), float(batch["label"].shape[0]), dtype=torch.float64, device=batch["label"].device)
        return torch.stack([top1.double(), n])

    def train_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        return {"top1": 100.0 * sums[0].item() / max(sums[1].item(), 1.0)}

    # .. planning ..........................................................................................
    def _feature_dim(self) -> int:
        from trainer.models.video import frame_feature_dim

        return frame_feature_dim(self.cfg.frame_backbone)

    def loader_sample_bytes(self, train: bool = True) -> int:
        """One clip in the loader's format: uint8 T x 3 x S x S, or float16 T x D with ``cache_features``."""
        cfg = self.cfg
        if cfg.cache_features:
            return cfg.num_frames * self._feature_dim() * 2
        return cfg.num_frames * 3 * cfg.image_size * cfg.image_size

    def host_data_bytes(self, data: Optional[TaskData], num_samples: Optional[int] = None) -> tuple[int, int]:
        """``(per training process, per host)`` bytes: arrays a ``.npz`` decompresses, and the memory-mapped ``.npy`` /
        cached feature files shared through the page cache.

        A ``.npz`` is decompressed by every process that reads it: each loader worker of the training split and,
        with ``persistent_workers``, of the validation split (the main process itself only with ``num_workers: 0``);
        measured in docs/benchmarks.md ("Video: host RAM per job"). Without scanned ``data`` (``plan --dataset-size
        N``), estimated for ``N`` pre-cut clips as seed 004 stored them: with ``cache_features`` the float16 cache
        (N x T x D x 2, per host); else for ``video_format: arrays`` a ``.npz`` of N x T x S x S x 3 uint8 (per
        reading process; the validation split unknown, left out); video files are read per sample (0, 0)."""
        cfg = self.cfg
        readers = max(1, cfg.num_workers)
        if data is None:
            if not num_samples:
                return 0, 0
            if cfg.cache_features:
                return 0, num_samples * cfg.num_frames * self._feature_dim() * 2
            if cfg.video_format == "arrays":
                return readers * num_samples * cfg.num_frames * 3 * cfg.image_size**2, 0
            return 0, 0
        train, val = data.train.source, data.val.source
        val_readers = readers if cfg.persistent_workers or cfg.num_workers == 0 else 0
        private = readers * int(getattr(train, "resident_bytes", 0)) + val_readers * int(
            getattr(val, "resident_bytes", 0)
        )
        return private, int(getattr(train, "file_bytes", 0)) + int(getattr(val, "file_bytes", 0))

    def example_batch(
        self, batch_size: int, *, image_size: Optional[int] = None, num_outputs: int = 1000, train: bool = True
    ) -> dict:
        """A device batch as :meth:`train_batch` returns it: clips float32 (B, T, 3, S, S) normalised, or float16
        features (B, T, D) with ``cache_features``; random labels over ``num_outputs`` classes."""
        cfg, dev = self.cfg, self.dist.device
        size = image_size or cfg.image_size
        label = torch.randint(0, num_outputs, (batch_size,), device=dev)
        if cfg.cache_features:
            feats = torch.randn(batch_size, cfg.num_frames, self._feature_dim(), device=dev).half()
            return {"features": feats, "label": label, "n": batch_size}
        u8 = torch.randint(0, 256, (batch_size, cfg.num_frames, 3, size, size), dtype=torch.uint8, device=dev)
        return {"clip": _normalize_clips(u8, dev), "label": label, "n": batch_size}

    # .. prediction (python -m trainer predict) .............................................................
    input_extensions = VIDEO_EXTENSIONS

    def predict_inputs(self, paths: list[str], *, first_index: int = 0) -> dict:
        """Decode the evaluation clip (the centred ``num_frames`` window at ``frame_stride``, padded when short) of
        each video file; plus ``"paths"``, ``"bad"`` and ``"frames"`` (the clips' middle frames, uint8 (3, S, S))."""
        from trainer.data.formats.video import clip_indices, collate_clips, probe_video, read_frames
        from trainer.data.samples import BadSample, describe_error

        cfg = self.cfg
        items, kept, bad = [], [], []
        for p in paths:
            try:
                info = probe_video(p)
                idx = clip_indices(info.num_frames, cfg.num_frames, cfg.frame_stride, "uniform", 0, "pad")
                items.append((read_frames(p, idx, cfg.image_size), 0, ()))
                kept.append(p)
            except Exception as e:  # noqa: BLE001 - any decoder failure: named and skipped
                bad.append(BadSample(p, describe_error(e)))
        batch = self.eval_batch(collate_clips(items)) if items else {"n": 0}
        batch.update(paths=kept, bad=bad, frames=[it[0][len(it[0]) // 2] for it in items])
        return batch

    def render_predictions(
        self,
        paths: list[str],
        batch: dict,
        outputs: torch.Tensor,
        label_space: dict,
        out_dir: str,
        score_threshold: float,
        *,
        out_names: Optional[list[str]] = None,
    ) -> list[dict]:
        """Records ``{"file", "top5": [{"label", "score"}, ...]}`` (softmax probabilities, top-k for fewer than 5
        classes); each clip's middle frame captioned with the top-1 class written as a PNG."""
        from trainer.tasks.prediction import render_top_k

        return render_top_k(paths, batch["frames"], outputs, label_space, out_dir, out_names)

    # .. export (python -m trainer export) ..................................................................
    export_input_names = ("clip",)
    export_output_names = ("logits", "probs")

    def export_unsupported(self, fmt: str) -> Optional[str]:
        """Cached-feature models (``cache_features``) take frame features, not clips: only safetensors."""
        if self.cfg.cache_features and fmt != "safetensors":
            return "a cache_features model takes cached frame features, not clips; export it as safetensors"
        return None

    def export_module(self, model: nn.Module) -> nn.Module:
        """Normalisation of each frame, the video model, then ``logits`` and ``probs`` float32 (B, C)."""
        return ExportWrapper(model, softmax_outputs)

    def export_example(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """float32 clips (B, T, 3, S, S) of pixel values in [0, 255], T = ``num_frames``, S = ``image_size``."""
        g = torch.Generator().manual_seed(0)
        cfg = self.cfg
        shape = (batch_size, cfg.num_frames, 3, cfg.image_size, cfg.image_size)
        return (torch.randint(0, 256, shape, generator=g).float(),)

    def export_inputs(self, batch: dict) -> tuple[torch.Tensor, ...]:
        """The clips of a :meth:`predict_inputs` batch as float32 pixel values (B, T, 3, S, S)."""
        clips = batch["clip"]
        b, t = clips.shape[:2]
        return (denormalize(clips.reshape(b * t, *clips.shape[2:])).reshape(clips.shape),)

    def export_metadata(self, label_space: dict, fmt: str = "onnx") -> dict:
        """The default facts for clips: layout B,T,3,S,S, ``num_frames``, ``frame_stride`` (the centred evaluation
        window), ``top_k`` 5."""
        cfg = self.cfg
        return {
            **super().export_metadata(label_space, fmt),
            "input_layout": "B,T,3,H,W RGB float32 pixel values in [0, 255]",
            "num_frames": cfg.num_frames,
            "frame_stride": cfg.frame_stride,
            "preprocess": f"{cfg.num_frames} frames every {cfg.frame_stride} from the clip's centre, each resized "
            f"(shorter side to {cfg.image_size} px, antialiased) and centre-cropped to {cfg.image_size}x"
            f"{cfg.image_size} (predict's read_frames)",
            "top_k": 5,
        }


def _check_rejected_clips(source, split: str, classes: list[str], cfg) -> list[str]:
    """With ``short_clips: reject``, the clips of ``split`` shorter than one clip span (``(num_frames - 1) *
    frame_stride + 1`` frames) are never trained on or scored: count them before training, per class.

    Returns report lines (empty when none is too short).

    Raises:
        DataError: every clip of a class is too short (the model would keep a class it never sees), or more than
            ``max_bad_fraction`` of the split's clips are.
    """
    from trainer.data.formats.video.clips import clip_span

    span = clip_span(cfg.num_frames, cfg.frame_stride)
    total, short = [0] * len(classes), [0] * len(classes)
    for i in range(len(source)):
        label = source.label(i)
        total[label] += 1
        short[label] += int(source.num_frames(i) < span)
    if not sum(short):
        return []
    emptied = [classes[k] for k in range(len(classes)) if total[k] and short[k] == total[k]]
    where = f"short_clips: reject ({split}, clips shorter than {span} frames = num_frames {cfg.num_frames} x stride"
    where += f" {cfg.frame_stride})"
    if emptied:
        raise DataError(
            f"{where}: every clip of class {', '.join(emptied[:3])} is too short, so the class would never be trained "
            "or scored; expected short_clips pad or loop, or a smaller num_frames / frame_stride"
        )
    if sum(short) > cfg.max_bad_fraction * len(source):
        raise DataError(
            f"{where}: {sum(short)} of {len(source)} clips are too short, more than max_bad_fraction "
            f"{cfg.max_bad_fraction:g}; expected short_clips pad or loop, or a smaller num_frames / frame_stride"
        )
    per_class = ", ".join(f"{classes[k]} {short[k]}/{total[k]}" for k in range(len(classes)) if short[k])
    return [f"data: {split}: {sum(short)} of {len(source)} clips too short, rejected ({per_class})"]
