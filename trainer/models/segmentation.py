"""Semantic segmentation models: segmentation_models_pytorch (smp) architectures with any smp encoder, and
torchvision's segmentation models, behind one builder.

:func:`build_segmentation_model` returns a module mapping float32 images ``(B, 3, H, W)`` (normalised) to float32
logits ``(B, num_classes, H, W)`` at the input resolution, with its encoder reachable as ``model.encoder``.
:func:`required_divisor` gives the multiple that H and W must be padded or cropped to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from trainer.errors import ConfigError, shorten

#: smp architectures by name -> class name in ``segmentation_models_pytorch``.
SMP_ARCHS = {
    "unet": "Unet",
    "unetplusplus": "UnetPlusPlus",
    "deeplabv3plus": "DeepLabV3Plus",
    "fpn": "FPN",
    "segformer": "Segformer",
}

#: torchvision segmentation builders (``torchvision.models.segmentation.<name>``) -> backbone output stride.
TORCHVISION_ARCHS = {
    "deeplabv3_resnet50": 8,
    "deeplabv3_mobilenet_v3_large": 16,
    "fcn_resnet50": 8,
    "lraspp_mobilenet_v3_large": 16,
}

#: Every name :func:`build_segmentation_model` accepts as ``arch``.
SEGMENTATION_MODELS = (*SMP_ARCHS, *TORCHVISION_ARCHS)


class TorchvisionSegmentation(nn.Module):
    """A torchvision segmentation model whose forward returns the ``"out"`` logits only (no aux classifier).

    Args:
        net: a ``torchvision.models.segmentation`` model (DeepLabV3, FCN or LRASPP) built without aux classifier.

    Forward: float32 ``(B, 3, H, W)`` -> float32 logits ``(B, num_classes, H, W)``; torchvision upsamples its
    output bilinearly to the input size, so any H, W run.
    """

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    @property
    def encoder(self) -> nn.Module:
        """The backbone (torchvision's ``net.backbone``, an ``IntermediateLayerGetter``)."""
        return self.net.backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)["out"]


def required_divisor(arch: str) -> int:
    """The multiple that input H and W must have for ``arch`` (pad or crop to it).

    smp: 32 for every architecture (the depth-5 encoder's output stride; smp 0.6.0 raises RuntimeError for other
    sizes in UnetPlusPlus, FPN and Segformer, DeepLabV3Plus needs 16, and Unet interpolates but aligns only at 32).
    torchvision: the backbone's output stride (8 for the dilated ResNet-50 models, 16 for the MobileNetV3 ones);
    their forward runs at any size, this multiple makes the feature grid align with the pixels.

    Raises:
        ConfigError: unknown ``arch``.
    """
    _check_arch(arch)
    return 32 if arch in SMP_ARCHS else TORCHVISION_ARCHS[arch]


def build_segmentation_model(
    arch: str, num_classes: int, encoder: str = "resnet34", encoder_weights: Optional[str] = None
) -> nn.Module:
    """A segmentation model: float32 ``(B, 3, H, W)`` normalised images -> float32 logits ``(B, num_classes, H, W)``.

    Args:
        arch: one of :data:`SEGMENTATION_MODELS`: an smp architecture (``unet`` = ``smp.Unet``, ``unetplusplus``,
            ``deeplabv3plus``, ``fpn``, ``segformer``; https://smp.readthedocs.io) or a torchvision builder name
            (``deeplabv3_resnet50``, ...; built with ``weights=None, weights_backbone=None``, no aux classifier).
        num_classes: output channels, >= 1.
        encoder: smp encoder name (``resnet34`` default, the U-Net encoder of the RID paper; ``resnet18``,
            ``mit_b0``, ``tu-<timm model>``, ...). Ignored for torchvision archs (the backbone is in the name).
        encoder_weights: None (random init) or a local file holding the encoder's state_dict (``torch.save`` of a
            dict of tensors, or a ``.safetensors`` file), loaded into ``model.encoder`` with strict key checking.

    H and W must be multiples of :func:`required_divisor` ``(arch)``.

    Raises:
        ConfigError: unknown ``arch``; ``num_classes`` < 1; an encoder smp cannot build; ``encoder_weights``
            missing, unreadable, or with missing / unexpected keys or mismatched shapes.
    """
    _check_arch(arch)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes: must be an integer >= 1, got {num_classes!r}")
    model = _build_smp(arch, num_classes, encoder) if arch in SMP_ARCHS else _build_torchvision(arch, num_classes)
    if encoder_weights is not None:
        _load_encoder(model.encoder, Path(encoder_weights), f"{arch}/{encoder if arch in SMP_ARCHS else 'backbone'}")
    return model


def _check_arch(arch: str) -> None:
    if arch not in SEGMENTATION_MODELS:
        raise ConfigError(f"arch: unknown segmentation model {arch!r}; known: {', '.join(SEGMENTATION_MODELS)}")


def _build_smp(arch: str, num_classes: int, encoder: str) -> nn.Module:
    import segmentation_models_pytorch as smp

    cls = getattr(smp, SMP_ARCHS[arch])
    try:
        return cls(encoder_name=encoder, encoder_weights=None, in_channels=3, classes=num_classes)
    except (KeyError, RuntimeError, ValueError, AssertionError) as e:
        detail = shorten(
            (str(e.args[0] if isinstance(e, KeyError) and e.args else e).splitlines() or [type(e).__name__])[0], 160
        )
        raise ConfigError(
            f"encoder: smp {smp.__version__} cannot build {arch!r} with encoder {encoder!r} ({detail}); "
            "names: segmentation_models_pytorch.encoders.get_encoder_names() or 'tu-<timm model>'"
        ) from None


def _build_torchvision(arch: str, num_classes: int) -> nn.Module:
    from torchvision.models import segmentation

    kwargs = {} if arch.startswith("lraspp") else {"aux_loss": False}
    net = getattr(segmentation, arch)(weights=None, weights_backbone=None, num_classes=num_classes, **kwargs)
    return TorchvisionSegmentation(net)


#: Classification-head prefixes of ImageNet checkpoints (torchvision ResNet ``fc.``, its MobileNet/EfficientNet
#: ``classifier.``), dropped from an ``encoder_weights`` file when the encoder has no such module (smp's encoders
#: delete the head), as ``frame_weights`` and ``pretrained_backbone`` accept the same files.
HEAD_PREFIXES = ("fc.", "classifier.")


def _load_encoder(encoder: nn.Module, path: Path, what: str) -> None:
    from trainer.models.local_weights import load_checked, read_state_dict

    own = encoder.state_dict()
    state = {
        k: v
        for k, v in read_state_dict(path, "encoder_weights", unwrap=("model", "state_dict")).items()
        if k in own or not k.startswith(HEAD_PREFIXES)
    }
    load_checked(encoder, state, path, "encoder_weights", f"the {what} encoder")


def sliding_window_logits(model: nn.Module, images: torch.Tensor, window: int, overlap: float) -> torch.Tensor:
    """Logits of ``images`` float (B, 3, H, W) from ``window x window`` tiles (the last row and column of tiles
    aligned to the far edge), ``overlap`` of the window shared between neighbours (stride ``window x (1 -
    overlap)``, at least 1 px), overlapping logits averaged: float32 (B, C, H, W). An image no larger than the
    window in both sides is one forward, identical to ``model(images)``. The usual evaluation of large
    aerial tiles (mmsegmentation's ``slide`` mode).

    Raises:
        ValueError: ``window`` < 1 or ``overlap`` outside [0, 1).
    """
    if window < 1 or not 0 <= overlap < 1:
        raise ValueError(f"sliding window: window {window} must be >= 1 and overlap {overlap} in [0, 1)")
    h, w = images.shape[-2:]
    if h <= window and w <= window:
        return model(images).float()
    stride = max(1, int(window * (1 - overlap)))

    def starts(size: int) -> list[int]:
        if size <= window:
            return [0]
        last = size - window
        return sorted({*range(0, last, stride), last})

    logits, counts = None, torch.zeros((1, 1, h, w), device=images.device)
    for y in starts(h):
        for x in starts(w):
            tile = model(images[..., y : y + window, x : x + window]).float()
            if logits is None:
                logits = torch.zeros((images.shape[0], tile.shape[1], h, w), device=images.device)
            logits[..., y : y + tile.shape[-2], x : x + tile.shape[-1]] += tile
            counts[..., y : y + tile.shape[-2], x : x + tile.shape[-1]] += 1
    return logits / counts
