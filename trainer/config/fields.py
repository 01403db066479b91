""":class:`TrainConfig`: every field of a training run, grouped by section (see :data:`SECTIONS`).

Fields are read as flat attributes (``cfg.lr``), saved flat (:meth:`TrainConfig.to_dict`) and compared flat on
resume; the section only says where a field goes in nested YAML, in ``--help`` and in the docs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Optional

from trainer.config.schema import (
    BUILTIN_DIGITS,
    CHECKPOINT_WRITERS,
    DECODE_DEVICES,
    DEVICES,
    FFCV_ORDERS,
    MAX_IMAGE_SIZE,
    OPTIMIZERS,
    PRECISIONS,
    SCHEDULERS,
    SECTIONS,
    config_field,
    is_task_section,
    task_names,
)

_run, _data, _loader, _optim, _speed, _ckpt, _log, _cls, _det, _seg, _vid = (
    functools.partial(config_field, s)
    for s in (
        "run",
        "data",
        "loader",
        "optim",
        "speed",
        "checkpoint",
        "logging",
        "classification",
        "detection",
        "segmentation",
        "video",
    )
)


@dataclass
class TrainConfig:
    """Everything a training run needs. Built by :func:`trainer.config.load_config`, checked by :meth:`validate`.

    Units: sizes in pixels, rates per optimizer step unless stated, times in seconds or minutes as named.
    """

    # --- run: what to train, when to stop ----------------------------------------------------------
    task: str = _run(
        "classification", "Task plug-in (trainer/tasks); the choices are the registered tasks.", choices=task_names
    )
    model: str = _run(
        "resnet50",
        "classification: any torchvision classification model (torchvision.models.list_models); "
        "detection: DINO-4scale's ResNet backbone (resnet18, resnet34, resnet50, resnet101); "
        "segmentation: the architecture (unet, deeplabv3plus, fpn, segformer... or a torchvision segmentation model); "
        "video: frame_transformer (seed 004: a frozen per-frame CNN + a Transformer over time) or a torchvision "
        "video model (r3d_18, mc3_18, r2plus1d_18, s3d, mvit_v1_b, swin3d_t).",
    )
    seed: int = _run(0, "Seed for weights, data order and augmentation (all ranks derive from it).")
    device: str = _run("auto", "auto | cpu | cuda.", choices=DEVICES)
    epochs: int = _run(90, "Number of training epochs.")
    max_steps_per_epoch: int = _run(0, "Cap optimizer steps per epoch (0 = full epoch); for smoke runs.")
    target_metric: Optional[str] = _run(
        None,
        "Validation metric that ends training early when it reaches "
        "target_value; default: the task's target metric (classification: top1). "
        "A name the task's evaluator reports, e.g. top1, top5, loss.",
    )
    target_value: Optional[float] = _run(
        None,
        "Stop once target_metric (EMA or raw) reaches this value (seed "
        "003's --target-accuracy, a top-1 percentage, is an alias).",
        aliases=("target_accuracy",),
    )

    # --- data ----------------------------------------------------------------------------------------
    data_dir: str = _data(
        BUILTIN_DIGITS,
        "ImageFolder root with train/ and val/ class folders, or "
        f"'{BUILTIN_DIGITS}' (scikit-learn's bundled digit scans, written once to a cache).",
        flag="--data-dir",
        aliases=("data",),
    )
    train_split: str = _data("train", "Sub-folder of data_dir used for training.")
    val_split: str = _data("val", "Sub-folder of data_dir used for evaluation.")
    use_ffcv: bool = _data(
        False,
        "Read FFCV .beton files (<ffcv_dir>/<train_split>.ffcv, <val_split>.ffcv) "
        "instead of the ImageFolder (seed 003's --use-ffcv; needs the ffcv extra: make ffcv).",
    )
    ffcv_dir: Optional[str] = _data(
        None,
        "Folder of the .ffcv files that python -m trainer write-ffcv makes "
        "(seed 003: /data/ffcv with train.ffcv and val.ffcv).",
    )
    ffcv_order: str = _data(
        "random",
        "FFCV traversal order: random (seed + epoch; single process or DDP) or "
        "quasi_random (single process only; reads page by page, for files larger than RAM "
        "with ffcv_os_cache off).",
        choices=FFCV_ORDERS,
    )
    ffcv_os_cache: bool = _data(
        True,
        "FFCV: read through the OS page cache, shared by all ranks of a host "
        "(ffcv-imagenet's in_memory=1); off = FFCV's own per-process page cache.",
    )
    max_bad_fraction: float = _data(
        0.01,
        "Abort when more than this fraction of an epoch's files cannot be "
        "decoded (they are skipped and counted below it).",
    )
    image_size: int = _data(
        224, f"Final training and evaluation resolution (pixels, square; at most {MAX_IMAGE_SIZE})."
    )
    hflip_prob: float = _data(
        0.5, "Probability of a horizontal flip in training (0 for digits or text); classification and detection."
    )

    # --- loader: batches and workers -----------------------------------------------------------------
    batch_size: int = _loader(
        256, "Global batch size: images per optimizer step over all ranks and accumulation steps."
    )
    accumulate_grad_batches: int = _loader(1, "Micro-batches accumulated per optimizer step on each rank.")
    eval_batch_size: int = _loader(0, "Per-rank evaluation batch (0 = the training micro-batch x 2).")
    num_workers: int = _loader(8, "DataLoader worker processes per rank.")
    prefetch_factor: int = _loader(2, "Batches each worker loads ahead (RAM = workers x prefetch x batch bytes).")
    pin_memory: bool = _loader(True, "Pin host batches for faster async host->GPU copies (ignored on CPU).")
    persistent_workers: bool = _loader(True, "Keep loader workers alive between epochs.")
    decode_device: str = _loader(
        "cpu",
        "Where classification's ImageFolder JPEGs are decoded: cpu (loader workers, libjpeg-turbo) or cuda "
        "(workers read the bytes and draw the crops; the training GPU decodes each batch with nvJPEG). "
        "Not with use_ffcv; recorded in checkpoints (a change is a config change on resume).",
        choices=DECODE_DEVICES,
    )

    # --- optim ---------------------------------------------------------------------------------------
    optimizer: str = _optim("sgd", "Optimizer.", choices=OPTIMIZERS)
    lr: float = _optim(0.1, "Peak learning rate for the global batch (no automatic scaling).")
    momentum: float = _optim(0.9, "SGD momentum (AdamW: beta1).")
    weight_decay: float = _optim(1e-4, "Decoupled (AdamW) or L2 (SGD) weight decay.")
    no_decay_norm_bias: bool = _optim(True, "Exclude normalisation weights and biases from weight decay.")
    scheduler: str = _optim(
        "cosine", "LR schedule after warmup (OneCycle includes its own warmup).", choices=SCHEDULERS
    )
    warmup_epochs: float = _optim(0.0, "Linear warmup length in epochs (fractions allowed).")
    step_size_epochs: int = _optim(30, "step scheduler: epochs between LR drops.")
    step_gamma: float = _optim(0.1, "step scheduler: LR multiplier at each drop.")
    gradient_clip: float = _optim(0.0, "Clip the global gradient L2 norm to this value (0 = off).")
    use_ema: bool = _optim(False, "Keep an exponential moving average of the weights and evaluate it too.")
    ema_decay: float = _optim(0.9998, "EMA decay per optimizer step.")

    # --- speed ---------------------------------------------------------------------------------------
    precision: str = _speed(
        "amp", "amp | 32 | bf16-mixed | 16-mixed (see trainer.config's module doc).", choices=PRECISIONS
    )
    channels_last: bool = _speed(True, "Use the channels_last memory format for model and inputs.")
    compile: bool = _speed(
        False,
        "torch.compile the model (detection: each encoder and decoder layer of DINO, not the whole model; refused "
        "with one line where Inductor cannot run).",
        aliases=("compile_model",),
    )
    tf32: bool = _speed(True, "Allow TF32 matmul/conv on Ampere and newer GPUs.")

    # --- checkpoint ----------------------------------------------------------------------------------
    checkpoint_dir: str = _ckpt("runs/default/checkpoints", "Where checkpoints go.")
    checkpoint_interval: int = _ckpt(1, "Keep a checkpoint every N epochs (the latest and the best are always kept).")
    keep_last_checkpoints: int = _ckpt(
        2,
        "Also keep the newest N checkpoints, mid-epoch ones too (>= 1). 2: the previous one is deleted only once "
        "a newer one has been durable for a whole checkpoint interval, so a copy that lags behind the folder "
        "(SageMaker's upload to S3, an FSx export) still holds a complete checkpoint when the newest is cut off.",
    )
    auto_resume: bool = _ckpt(True, "At start, resume from the newest complete checkpoint in checkpoint_dir.")
    resume: Optional[str] = _ckpt(None, "Resume from this checkpoint directory (overrides auto_resume).")
    force_resume: bool = _ckpt(
        False,
        "Resume even if training-relevant config fields changed since the "
        "checkpoint (they are listed); a changed schedule restarts at the saved step.",
    )
    checkpoint_every_steps: int = _ckpt(
        0, "Also checkpoint every N optimizer steps, mid-epoch (0 = off); bounds what a SIGKILL loses."
    )
    checkpoint_every_minutes: float = _ckpt(
        0.0,
        "Also checkpoint every N minutes of training, mid-epoch (0 = off; "
        "inside SageMaker 10 by default, since SIGTERM may not reach us there).",
    )
    checkpoint_writer: str = _ckpt(
        "auto",
        "Who serialises, hashes and writes a checkpoint: a thread of the training process, or a writer process on "
        "shared memory (off the GIL and the training step); auto = the process for states of 128 MiB or more.",
        choices=CHECKPOINT_WRITERS,
    )
    spot_poll_interval_s: float = _ckpt(5.0, "Seconds between EC2 spot interruption-notice polls (IMDSv2).")
    stop_on_rebalance: bool = _ckpt(False, "Also checkpoint and stop on an EC2 rebalance recommendation.")

    # --- logging -------------------------------------------------------------------------------------
    log_dir: str = _log("runs/default/logs", "Metrics JSONL, TensorBoard events and the curves PNG go here.")
    log_every_steps: int = _log(50, "Plain progress line every N optimizer steps (no terminal attached).")
    tracking: list = _log(
        [],
        "Experiment trackers beside JSONL/TensorBoard, rank 0: mlflow, wandb, or both (--tracking mlflow,wandb). "
        "Metrics are named <kind>/<JSONL key> (step/loss, epoch/val_top1); an unreachable tracker is a warning.",
    )
    tracking_uri: Optional[str] = _log(
        None,
        "MLflow tracking URI: file:/path (local store), http(s)://host, or a SageMaker managed MLflow tracking "
        "server ARN (arn:aws:sagemaker:...:mlflow-tracking-server/NAME; needs the sagemaker-mlflow plugin); "
        "default: MLFLOW_TRACKING_URI, else a file store at <log_dir>/mlruns. A scheme this install cannot open (sqlite: "
        "without SQLAlchemy, ftp:) is refused. W&B reads WANDB_* variables instead.",
    )
    tracking_experiment: str = _log(
        "trainstack", "MLflow experiment / W&B project of the tracked run (created when missing)."
    )
    tracking_run_name: Optional[str] = _log(None, "Name of the tracked run (default: the tracker's generated name).")

    # --- classification (task section: only with task: classification) ------------------------------
    weights: Optional[str] = _cls(
        None,
        "Start from pretrained weights: a torchvision weights name of model (IMAGENET1K_V2, DEFAULT; from torch.hub's "
        "cache, downloaded once when online) or a local .pth/.safetensors state_dict or timm/torchvision checkpoint; "
        "the classifier head is replaced when its classes differ from the data's (docs/classification.md).",
    )
    label_smoothing: float = _cls(0.0, "Label smoothing for the cross-entropy loss, in [0, 1).")
    mixup_alpha: float = _cls(0.0, "MixUp Beta(alpha, alpha) parameter (0 = MixUp off).")
    cutmix_alpha: float = _cls(1.0, "CutMix Beta(alpha, alpha) parameter (0 = CutMix off).")
    cutmix_prob: float = _cls(
        0.0, "Share of batches mixed with CutMix; the rest use MixUp when mixup_alpha > 0, otherwise stay unmixed."
    )
    crop_scale_min: float = _cls(0.08, "RandomResizedCrop's lower area bound (0.08 = ImageNet default).")
    val_resize_ratio: float = _cls(
        0.875,
        "Evaluation: resize shorter side to image_size/ratio, centre-crop image_size (the standard ImageNet protocol).",
    )
    progressive_resize: bool = _cls(
        False,
        "Train at low resolution first, then step up to image_size "
        "(seed 003: 160 -> 192 -> 224 over equal thirds of the epochs).",
    )
    progressive_min_size: int = _cls(160, "First resolution of progressive resizing (pixels; at most image_size).")
    progressive_stages: int = _cls(3, "Number of equal-length resolution stages in progressive resizing.")

    # --- detection (task section: only with task: detection; DINO-4scale, upstream defaults) ----------
    coco_annotations: str = _det(
        "annotations/instances_{split}.json",
        "COCO annotations JSON of a split, relative to data_dir; {split} becomes train_split or val_split "
        "(facemask-coco: annotations/custom_{split}.json).",
    )
    coco_images: str = _det("{split}2017", "Image folder of a split, relative to data_dir; {split} as above.")
    label_space: str = _det(
        "contiguous",
        "What a class index is: contiguous = the K categories numbered 0..K-1 in id order; coco_ids = the COCO "
        "category id itself, max id + 1 classes (upstream DINO: 91 on COCO 2017), so an upstream checkpoint's class "
        "heads load as they are (docs/detection.md).",
        choices=("contiguous", "coco_ids"),
    )
    max_category_id: int = _det(
        10_000,
        "label_space: coco_ids builds max id + 1 outputs per class head: a category id above this refuses the data "
        "(one stray id 10**6 would build a million-class head). COCO 2017's largest is 90; LVIS's 1203.",
    )
    pad_value: str = _det(
        "mean",
        "Padding of batches and canvases: mean = the mean colour, 0 after normalisation (upstream DINO's "
        "nested_tensor_from_tensor_list); black = pixel value 0 before normalisation (the padding before 2026-11-28).",
        choices=("mean", "black"),
        legacy="black",
    )
    eval_protocol: str = _det(
        "batched",
        "Evaluation: batched = eval_batch_size images per forward, padded (or on canvases); upstream = every image "
        "at its own size without padding, as upstream DINO's main.py (validation batch 1): exact, slower "
        "(docs/detection.md).",
        choices=("batched", "upstream"),
    )
    crop_prob: float = _det(0.5, "Share of training images through DINO's crop branch (resize, random crop, resize).")
    min_scale: int = _det(480, "Training resize: shortest side drawn from min_scale..max_scale (pixels).")
    max_scale: int = _det(800, "Training resize: largest shortest side (pixels); the crop branch scales with it.")
    scale_step: int = _det(32, "Training resize: step between the shortest-side choices (pixels).")
    max_size: int = _det(1333, "Longest side after any resize, training and evaluation (pixels).")
    eval_size: int = _det(800, "Evaluation resize: shortest side (pixels), longest at most max_size.")
    pad_to_multiple: int = _det(
        64,
        "Batches are padded up to a multiple of this many pixels (1 = the exact largest image, as upstream), so "
        "padded sizes repeat from batch to batch (torch.compile, cuDNN autotuning) and the stride-64 level has no "
        "partial pixel.",
    )
    canvases: str = _det(
        "",
        "Fixed padded batch shapes (docs/detection.md): empty = each batch padded to its own largest image "
        "(rounded up to pad_to_multiple); auto = at most 4 training and 2 evaluation canvases chosen from the "
        "training set's sizes through the transform; or HxW,HxW,... (multiples of pad_to_multiple, one at least "
        "max_size on both sides). YAML may also give [[H, W], ...].",
    )
    num_queries: int = _det(900, "DINO queries (anchors from the top encoder proposals).")
    num_select: int = _det(300, "Detections kept per image after post-processing (top-k over query x class).")
    dn_number: int = _det(100, "Contrastive denoising queries (0 = no denoising).")
    dn_box_noise_scale: float = _det(0.4, "Denoising box noise scale (negatives get up to twice as much).")
    dn_label_noise_ratio: float = _det(0.5, "Share of denoising labels flipped to a random class.")
    dn_max_boxes: int = _det(
        0,
        "0 = the denoising part sized per batch from its largest image's box count (upstream); N > 0 = padded with "
        "inert queries to one size for every batch (200 for dn_number 100 and N <= 100), so with canvases the "
        "decoder's shapes depend on the canvas alone; an image's boxes past N get no denoising query "
        "(docs/detection.md).",
    )
    matcher: str = _det(
        "scipy",
        "Hungarian matching solver: scipy = one device-to-host copy of the costs, SciPy per image and prediction set "
        "(the reference); batched = every image and set at once on the training device with torch-linear-assignment "
        "(Triton on CUDA: no host read; its SciPy loop on the CPU); auto = batched on CUDA when its Triton solver "
        "imports, else scipy (docs/detection.md).",
        choices=("scipy", "batched", "auto"),
    )
    cuda_graphs: bool = _det(
        False,
        "Replay DINO's forward and backward (backbone to heads) from CUDA graphs, one captured per canvas; "
        "denoising's layout, the matcher, the loss and the optimizer stay eager. Needs one CUDA process, canvases, "
        "dn_max_boxes > 0 (with denoising), no compile and accumulate_grad_batches 1 (docs/detection.md).",
    )
    hidden_dim: int = _det(256, "Transformer width.")
    dim_feedforward: int = _det(2048, "Transformer feed-forward width.")
    nheads: int = _det(8, "Attention heads.")
    enc_layers: int = _det(6, "Deformable encoder layers.")
    dec_layers: int = _det(6, "Deformable decoder layers.")
    enc_n_points: int = _det(4, "Sampling points per head and level in the encoder.")
    dec_n_points: int = _det(4, "Sampling points per head and level in the decoder.")
    backbone_lr_scale: float = _det(0.1, "Backbone learning rate as a multiple of lr (upstream: 1e-5 at 1e-4).")
    pretrained_backbone: Optional[str] = _det(
        None, "Local torchvision ResNet state_dict file (.pth) for the backbone (offline ImageNet weights)."
    )
    init_from: Optional[str] = _det(
        None,
        "Upstream DINO checkpoint (.pth, e.g. checkpoint0011_4scale.pth) to fine-tune from: names mapped, shapes "
        "checked, class heads and label_enc re-initialised when num_classes differs, the rest reported. "
        "A resumed run takes its checkpoint's weights instead (they are loaded after the model is built).",
    )

    # --- segmentation (task section: only with task: segmentation) ------------------------------------
    seg_images: str = _seg("images", "Image folder relative to data_dir; {split} becomes train_split or val_split.")
    seg_masks: str = _seg("masks", "Mask folder relative to data_dir; {split} as above (may equal seg_images).")
    mask_suffix: str = _seg(
        "", "The mask of image <stem>.<ext> is <stem><mask_suffix>.<any image ext> (RID: _reviewed)."
    )
    image_glob: str = _seg(
        "*", "Only image files matching this pattern (fnmatch), e.g. *.jpg when masks share the folder."
    )
    classes: list = _seg([], "Class names, index = class id in the masks (required).")
    palette: list = _seg(
        [], "Colour masks: one R,G,B per class in class order (e.g. ['0,0,0', '255,0,0']); empty: masks hold ids."
    )
    unknown_colour: str = _seg(
        "error",
        "A mask colour not in the palette: error (the file counts as bad) or ignore (ignore_index).",
        choices=("error", "ignore"),
    )
    palette_tolerance: int = _seg(
        0, "Palette match: the nearest colour counts when no channel differs by more than this (lossy masks)."
    )
    ignore_index: int = _seg(255, "Mask value excluded from loss and metrics (also the padding of crops and batches).")
    val_fraction: float = _seg(
        0.0, "Folders without {split}: this share of the pairs (fixed by a hash of the file name) is the val split."
    )
    max_samples: int = _seg(
        0, "Use only the first N training pairs in name order (0 = all; seed 001's 10 per dataset)."
    )
    scale_min: float = _seg(0.5, "Training scale jitter: shorter side drawn from scale_min..scale_max x image_size.")
    scale_max: float = _seg(2.0, "Training scale jitter: upper bound (then a random image_size crop, padded if small).")
    tile_window: int = _seg(
        0,
        "Training: images larger than this on a side are first cut to a random window of this side (pixels), "
        "so large aerial tiles keep their resolution; 0 = never (the scale jitter sees the whole image).",
    )
    eval_resize: bool = _seg(True, "Evaluation: resize the shorter side to image_size (false: the file's resolution).")
    eval_window: int = _seg(
        0, "Evaluation: sliding windows of this side (pixels, a multiple of the model's stride; 0 = whole image)."
    )
    eval_overlap: float = _seg(1 / 3, "Evaluation: overlap of neighbouring windows (share of eval_window, 0..0.9).")
    encoder: str = _seg("resnet34", "Encoder of smp architectures (resnet34 as in the RID paper's U-Net).")
    encoder_weights: Optional[str] = _seg(
        None, "Local state_dict file for the encoder (offline; smp downloads otherwise)."
    )
    datasets: list = _seg(
        [],
        "Several datasets in one run: a list of mappings (name, data_dir relative to data_dir, seg_images, "
        "seg_masks, mask_suffix, image_glob, classes, palette, palette_tolerance, unknown_colour, class_map onto "
        "classes, max_samples, weight, val_fraction); empty: the fields above describe the one dataset.",
    )
    epochs_per_dataset: int = _seg(
        0, "With several datasets: train on one at a time, this many epochs each, in order (0 = all together)."
    )
    ce_weight: float = _seg(1.0, "Weight of the cross-entropy term of the loss.")
    dice_weight: float = _seg(1.0, "Weight of the Dice term of the loss.")

    # --- video (task section: only with task: video) --------------------------------------------------
    video_format: str = _vid(
        "folders",
        "folders: <data_dir>/<split>/<class>/*.mp4|.avi|.webm (Kinetics/UCF101 layout), decoded with PyAV; arrays: "
        "<data_dir>/<split>.npz (clips uint8 (N, T, H, W, 3) + labels) or <split>_clips.npy + <split>_labels.npy "
        "(memory-mapped).",
        choices=("folders", "arrays"),
    )
    num_frames: int = _vid(32, "Frames per clip (T; seed 004: 32).")
    frame_stride: int = _vid(1, "Take every N-th frame of the source inside a clip.")
    temporal_crop: str = _vid(
        "random",
        "Training clip position: random (a random window per epoch, a function of seed, epoch and index) or uniform "
        "(the centred window, as in evaluation).",
        choices=("random", "uniform"),
    )
    short_clips: str = _vid(
        "pad",
        "Videos shorter than num_frames x frame_stride: pad (repeat the last frame) or reject (left out, counted).",
        choices=("pad", "reject"),
    )
    frame_backbone: str = _vid(
        "resnet18", "frame_transformer: the frozen per-frame torchvision ResNet (resnet18, resnet34, resnet50)."
    )
    frame_weights: Optional[str] = _vid(
        None, "frame_transformer: local torchvision state_dict file (.pth) for the frozen backbone (offline weights)."
    )
    temporal_dim: int = _vid(256, "frame_transformer: Transformer width (frame features are projected to it).")
    temporal_layers: int = _vid(4, "frame_transformer: Transformer encoder layers.")
    temporal_heads: int = _vid(8, "frame_transformer: attention heads.")
    temporal_mlp_dim: int = _vid(1024, "frame_transformer: feed-forward width.")
    temporal_dropout: float = _vid(0.1, "frame_transformer: dropout in the Transformer.")
    cache_features: bool = _vid(
        False,
        "frame_transformer: compute the frozen backbone's per-frame features once (fp16 on disk) and train the "
        "Transformer on them; needs hflip_prob 0 (no augmentation that changes frames).",
    )
    feature_cache_dir: Optional[str] = _vid(
        None, "Folder of the feature cache (default: <checkpoint_dir>/../feature-cache); keyed by clip, weights, size."
    )

    # ------------------------------------------------------------------------------------------------
    def validate(self) -> TrainConfig:
        """Check every field; raise :class:`ConfigError` naming the first bad field and what is allowed.

        Returns ``self`` so calls can chain. Cross-rank checks (micro-batch divisibility) live in
        :meth:`micro_batch_size`, which needs the world size. See :func:`trainer.config.validation.validate`.
        """
        from trainer.config.validation import validate

        return validate(self)

    def micro_batch_size(self, world_size: int) -> int:
        """Per-rank images per forward/backward: ``batch_size / (world_size * accumulate_grad_batches)``.

        Raises:
            ConfigError: the global batch does not split evenly into whole micro-batches.
        """
        from trainer.errors import ConfigError

        denom = world_size * self.accumulate_grad_batches
        if self.batch_size % denom:
            raise ConfigError(
                f"batch_size: global batch {self.batch_size} is not divisible by world_size ({world_size}) x "
                f"accumulate_grad_batches ({self.accumulate_grad_batches}) = {denom}; choose a multiple of {denom}"
            )
        return self.batch_size // denom

    def to_dict(self) -> dict:
        """Plain flat dict of all fields, field name -> value (YAML/JSON-serialisable; no sections)."""
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """SHA-256 (hex, 16 chars) of the fields that define the training trajectory.

        Fields that only say where things go or how often to log (:data:`NON_TRAJECTORY_FIELDS`) are excluded,
        so moving a run to another checkpoint directory does not change it.
        """
        d = {k: v for k, v in self.to_dict().items() if k not in NON_TRAJECTORY_FIELDS}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


#: Fields that do not change what is computed (paths, logging, resume switches, loader tuning, early stopping).
#: Also used to filter the keys of a saved config dict on resume, so it keeps ``target_accuracy`` (the name of
#: ``target_value`` in checkpoints written before the rename): its presence there is not a config change.
NON_TRAJECTORY_FIELDS = (
    "cuda_graphs",
    "checkpoint_dir",
    "log_dir",
    "auto_resume",
    "resume",
    "force_resume",
    "log_every_steps",
    "tracking",
    "tracking_uri",
    "tracking_experiment",
    "tracking_run_name",
    "checkpoint_interval",
    "keep_last_checkpoints",
    "target_metric",
    "target_value",
    "target_accuracy",
    "num_workers",
    "prefetch_factor",
    "pin_memory",
    "persistent_workers",
    "data_dir",
    "eval_batch_size",
    "eval_protocol",
    "max_steps_per_epoch",
    "device",
    "checkpoint_every_steps",
    "checkpoint_every_minutes",
    "checkpoint_writer",
    "spot_poll_interval_s",
    "stop_on_rebalance",
    "ffcv_dir",
    "ffcv_os_cache",
    "feature_cache_dir",
)

#: Field name -> dataclass field (its ``metadata`` holds section, help, flag, choices, aliases), in section order.
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
#: Alias (YAML key or hidden flag name) -> field name, e.g. ``compile_model`` -> ``compile``.
ALIASES = {a: f.name for f in FIELDS.values() for a in f.metadata.get("aliases", ())}
#: Section name -> its field names, in :data:`SECTIONS` order (every section has at least one field).
FIELDS_BY_SECTION: dict[str, tuple[str, ...]] = {
    s: tuple(n for n, f in FIELDS.items() if f.metadata["section"] == s) for s in SECTIONS
}


def saved_config(saved: dict) -> dict:
    """A checkpoint's stored config (``state["config"]``, a plain dict) with every field it lacks that has a
    ``legacy`` value (:func:`trainer.config.schema.config_field`) filled with that value: the setting the older
    trainer that wrote it actually used (e.g. ``pad_value: black`` for detection checkpoints older than the field).
    Only the fields of shared sections and of the checkpoint's own task (``saved["task"]``) are filled; fields
    without a legacy value stay absent (their default reproduces the older trainer). Returns a new dict."""
    out = dict(saved)
    for name, f in FIELDS.items():
        section = f.metadata["section"]
        own = not is_task_section(section) or section == saved.get("task")
        if name not in out and own and f.metadata.get("legacy") is not None:
            out[name] = f.metadata["legacy"]
    return out
