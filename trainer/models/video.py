"""Video classifiers: clips (B, T, 3, H, W) of ImageNet-normalised float frames -> logits (B, num_classes).

- ``frame_transformer``: a frozen torchvision ResNet applied to each frame (512-d features for resnet18/34,
  2048-d for resnet50), then a small trainable Transformer encoder over the T frame features with a class token
  and learnable positional embeddings (ViT-style, Dosovitskiy et al. 2021, arXiv 2010.11929, applied over time).
- the torchvision video models (``torchvision.models.list_models(module=torchvision.models.video)``: r3d_18,
  mc3_18, r2plus1d_18, s3d, mvit_v1_b, mvit_v2_s, swin3d_t/s/b), built untrained and fed (B, 3, T, H, W).
"""

from __future__ import annotations

import difflib
from types import SimpleNamespace
from typing import Optional

import torch
import torchvision
from torch import Tensor, nn
from torch._guards import active_fake_mode

from trainer.errors import ConfigError

TORCHVISION_VIDEO_MODELS = tuple(sorted(torchvision.models.list_models(module=torchvision.models.video)))
VIDEO_MODELS = ("frame_transformer", *TORCHVISION_VIDEO_MODELS)
FRAME_BACKBONES = tuple(sorted(torchvision.models.list_models(include=["resnet*", "resnext*", "wide_resnet*"])))


def _unknown(field: str, what: str, name: str, names) -> ConfigError:
    close = difflib.get_close_matches(str(name), list(names), n=4)
    hint = f"did you mean {', '.join(close)}?" if close else f"choose one of {', '.join(names)}"
    return ConfigError(f"{field}: unknown {what} {name!r}; {hint}")


def load_frame_weights(backbone: nn.Module, path) -> None:
    """Load a local torchvision ResNet state_dict (``torch.load(weights_only=True)``) into ``backbone`` (a ResNet
    whose ``fc`` is ``nn.Identity``). The file's ``fc.*`` keys, if any, are ignored.

    Raises:
        ConfigError: ``frame_weights``: no such file, unreadable, not a dict of tensors, or keys missing /
            unexpected / of another shape (the file and the first offending keys are named).
    """
    from trainer.models.local_weights import load_checked, read_state_dict

    state = {k: v for k, v in read_state_dict(path, "frame_weights").items() if not k.startswith("fc.")}
    load_checked(backbone, state, path, "frame_weights", "the frame backbone")


def frozen_resnet(name: str = "resnet18", weights: Optional[str] = None) -> nn.Module:
    """torchvision ResNet ``name`` without its ``fc`` (``nn.Identity``): float (N, 3, H, W) -> (N, D), frozen
    (``requires_grad`` False, eval mode), with attribute ``feature_dim`` = D (512 for resnet18/34, 2048 for
    resnet50); weights from the local file ``weights`` (:func:`load_frame_weights`) or torchvision's random init
    (the global torch RNG).

    Raises:
        ConfigError: unknown ``frame_backbone``; bad ``frame_weights`` file.
    """
    if name not in FRAME_BACKBONES:
        raise _unknown("frame_backbone", "frame backbone", name, FRAME_BACKBONES)
    backbone = torchvision.models.get_model(name, weights=None)
    feature_dim = int(backbone.fc.in_features)
    backbone.fc = nn.Identity()
    if weights:
        load_frame_weights(backbone, weights)
    backbone.requires_grad_(False)
    backbone.feature_dim = feature_dim
    return backbone.eval()


def build_frame_backbone(cfg) -> nn.Module:
    """:func:`frozen_resnet` of ``cfg.frame_backbone`` / ``cfg.frame_weights`` (the video task builds it alone to fill
    the feature cache with the weights the model will hold)."""
    return frozen_resnet(getattr(cfg, "frame_backbone", "resnet18"), getattr(cfg, "frame_weights", None))


def frame_feature_dim(name: str) -> int:
    """Feature width D of frame backbone ``name`` (built on the meta device: no memory, no weights).

    Raises:
        ConfigError: unknown backbone name.
    """
    if name not in FRAME_BACKBONES:
        raise _unknown("frame_backbone", "frame backbone", name, FRAME_BACKBONES)
    with torch.device("meta"):
        return int(torchvision.models.get_model(name, weights=None).fc.in_features)


class FrameTransformer(nn.Module):
    """Frozen per-frame ResNet + trainable temporal Transformer encoder.

    Per frame: ResNet (no ``fc``) -> ``feature_dim`` features (512 for resnet18/34, 2048 for resnet50), frozen
    (``requires_grad`` False, BatchNorm always in eval mode, run under ``torch.no_grad()``). Over time:
    Linear(feature_dim -> dim), prepend a learnable class token, add learnable positional embeddings
    (``max_frames + 1`` positions, so the logits depend on frame order), ``depth`` pre-norm GELU
    ``nn.TransformerEncoderLayer`` (batch_first) in ``self.layers``, LayerNorm, Linear head on the class token.
    Builds and runs under ``FakeTensorMode`` (no value-reading init).

    Args:
        num_classes: C. frame_backbone: a torchvision ResNet name. frame_weights: optional local state_dict
        file for the backbone (torchvision ResNet keys, with or without ``fc.*``). max_frames: largest T.
        backbone: an already built :func:`frozen_resnet` to hold instead (the video task passes the one it
        filled the feature cache with); ``frame_backbone`` / ``frame_weights`` are then not read.

    Raises:
        ConfigError: unknown ``frame_backbone``; bad ``frame_weights`` file (see :func:`load_frame_weights`).
    """

    def __init__(
        self,
        num_classes: int,
        frame_backbone: str = "resnet18",
        frame_weights: Optional[str] = None,
        dim: int = 256,
        depth: int = 4,
        heads: int = 8,
        mlp_dim: int = 1024,
        dropout: float = 0.1,
        max_frames: int = 32,
        backbone: Optional[nn.Module] = None,
    ):
        super().__init__()
        self.backbone = backbone if backbone is not None else frozen_resnet(frame_backbone, frame_weights)
        self.feature_dim = self.backbone.feature_dim
        self.max_frames = int(max_frames)
        self.proj = nn.Linear(self.feature_dim, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.empty(1, self.max_frames + 1, dim))
        nn.init.normal_(self.pos_embed, std=0.02)  # trunc_normal_ reads values: not under FakeTensorMode
        nn.init.normal_(self.cls_token, std=0.02)
        # The layers of nn.TransformerEncoder(layer, depth) without its deepcopy: each layer is initialised on
        # its own (the clones would start equal) and no fake tensor is deep-copied under FakeTensorMode.
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, mlp_dim, dropout, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def train(self, mode: bool = True) -> FrameTransformer:
        """As ``nn.Module.train``, but the frozen backbone stays in eval mode (its BatchNorm statistics are fixed)."""
        super().train(mode)
        self.backbone.eval()
        return self

    def frame_features(self, frames: Tensor) -> Tensor:
        """frames float (N, 3, H, W), ImageNet-normalised -> features float32 (N, feature_dim), without grad."""
        with torch.no_grad():
            return self.backbone(frames).float()

    def forward_features(self, features: Tensor) -> Tensor:
        """features (B, T, feature_dim), any float dtype (e.g. fp16 from a feature cache) -> logits (B, C).

        Raises:
            ValueError: not (B, T, feature_dim), or T > max_frames (both named).
        """
        if features.dim() != 3 or features.shape[-1] != self.feature_dim:
            raise ValueError(f"expected features (B, T, {self.feature_dim}), got {tuple(features.shape)}")
        b, t, _ = features.shape
        if t > self.max_frames:
            raise ValueError(f"clip has T={t} frames, more than max_frames={self.max_frames} (num_frames)")
        x = self.proj(features.to(self.proj.weight.dtype))
        x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1) + self.pos_embed[:, : t + 1]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))

    def forward(self, clip: Tensor) -> Tensor:
        """clip float (B, T, 3, H, W), ImageNet-normalised -> logits (B, C); a 3-D input (B, T, feature_dim) is taken
        as cached frame features (:meth:`forward_features`), so DDP's forward sees both paths.

        Raises:
            ValueError: not 5-D with 3 channels (nor 3-D features), or T > max_frames.
        """
        if clip.dim() == 3:
            return self.forward_features(clip)
        if clip.dim() != 5 or clip.shape[2] != 3:
            raise ValueError(f"expected a clip (B, T, 3, H, W), got {tuple(clip.shape)}")
        b, t = clip.shape[:2]
        if t > self.max_frames:
            raise ValueError(f"clip has T={t} frames, more than max_frames={self.max_frames} (num_frames)")
        features = self.frame_features(clip.flatten(0, 1)).to(clip.dtype).unflatten(0, (b, t))
        return self.forward_features(features)


def _empty_on(module: nn.Module, device: torch.device) -> None:
    """Replace every parameter and buffer of ``module`` by an uninitialised one of the same shape, dtype and
    ``requires_grad`` on ``device`` (as ``Module.to_empty``, which cannot swap the fake meta tensors made under
    FakeTensorMode)."""
    for mod in module.modules():
        for key, p in mod._parameters.items():
            if p is not None:
                mod._parameters[key] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
        for key, b in mod._buffers.items():
            if b is not None:
                mod._buffers[key] = torch.empty_like(b, device=device)


class TorchvisionVideoModel(nn.Module):
    """A torchvision video classifier (``get_model(name, weights=None, num_classes=num_classes)``, as ``.net``)
    taking clips float (B, T, 3, H, W) -> logits (B, C); torchvision's models take (B, 3, T, H, W).

    Raises:
        ConfigError: ``name`` is not in ``torchvision.models.list_models(module=torchvision.models.video)``.
    """

    def __init__(self, name: str, num_classes: int):
        super().__init__()
        if name not in TORCHVISION_VIDEO_MODELS:
            raise _unknown("model", "video model", name, VIDEO_MODELS)
        self.name = name
        if active_fake_mode() is None:
            self.net = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
        else:  # FakeTensorMode: the init of mvit/swin3d reads values (trunc_normal_); shapes are all it needs
            device = torch.empty(0).device  # the device the caller builds on (a torch.device context or cpu)
            with torch.device("meta"):
                self.net = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
            _empty_on(self.net, device)

    def forward(self, clip: Tensor) -> Tensor:
        """clip float (B, T, 3, H, W) -> logits (B, C)."""
        return self.net(clip.permute(0, 2, 1, 3, 4))


def build_video_model(cfg, num_classes: int, backbone: Optional[nn.Module] = None) -> nn.Module:
    """The video model named by ``cfg.model`` (one of :data:`VIDEO_MODELS`) for ``num_classes`` classes.

    Reads (via getattr, defaults as in the config): ``model``, ``frame_backbone`` ("resnet18"), ``frame_weights``
    (None), ``temporal_dim`` (256), ``temporal_layers`` (4), ``temporal_heads`` (8), ``temporal_mlp_dim`` (1024),
    ``temporal_dropout`` (0.1), ``num_frames`` (32, the frame transformer's ``max_frames``).

    Raises:
        ConfigError: unknown ``model`` or ``frame_backbone`` (closest names suggested); ``temporal_heads`` does
            not divide ``temporal_dim``; bad ``frame_weights`` file.
    """
    name = getattr(cfg, "model", None)
    if name not in VIDEO_MODELS:
        raise _unknown("model", "video model", name, VIDEO_MODELS)
    if name != "frame_transformer":
        return TorchvisionVideoModel(name, num_classes)
    dim, heads = int(getattr(cfg, "temporal_dim", 256)), int(getattr(cfg, "temporal_heads", 8))
    if heads < 1 or dim < 1 or dim % heads:
        raise ConfigError(f"temporal_heads: {heads} must divide temporal_dim={dim} (both >= 1)")
    return FrameTransformer(
        num_classes,
        frame_backbone=getattr(cfg, "frame_backbone", "resnet18"),
        frame_weights=getattr(cfg, "frame_weights", None),
        dim=dim,
        depth=int(getattr(cfg, "temporal_layers", 4)),
        heads=heads,
        mlp_dim=int(getattr(cfg, "temporal_mlp_dim", 1024)),
        dropout=float(getattr(cfg, "temporal_dropout", 0.1)),
        max_frames=int(getattr(cfg, "num_frames", 32)),
        backbone=backbone,
    )


def check_video_input(cfg) -> None:
    """Check that ``cfg.model`` accepts clips of ``cfg.num_frames`` frames of ``cfg.image_size`` pixels square.

    The model is built on the meta device (``frame_weights`` not read) and run once in eval mode on a
    (1, T, 3, S, S) meta tensor: shapes only, no memory. Models that cannot be built or run on meta are not
    checked.

    Raises:
        ConfigError: unknown model; or the model rejects the size (e.g. mvit_v1_b needs 16 frames of 224 px,
            s3d has minimum sizes), naming ``model``, ``num_frames``, ``image_size`` and the model's message.
    """
    t, s = int(getattr(cfg, "num_frames", 32)), int(getattr(cfg, "image_size", 224))
    from trainer.models.meta_check import meta_rejection

    shape_cfg = SimpleNamespace(**{**_fields(cfg), "frame_weights": None})
    rejected = meta_rejection(lambda: build_video_model(shape_cfg, 10), [(1, t, 3, s, s)])
    if rejected:
        raise ConfigError(
            f"model: {shape_cfg.model} cannot take clips of num_frames={t} frames of {s}x{s} pixels "
            f"(image_size={s}): {rejected[1]}; choose another num_frames, image_size or model"
        )


_FIELDS = (
    "model",
    "frame_backbone",
    "frame_weights",
    "temporal_dim",
    "temporal_layers",
    "temporal_heads",
    "temporal_mlp_dim",
    "temporal_dropout",
    "num_frames",
)


def _fields(cfg) -> dict:
    return {k: getattr(cfg, k) for k in _FIELDS if hasattr(cfg, k)}
