"""ResNet backbone with frozen BatchNorm and the sine position encoding of DINO (upstream ``backbone.py`` and
``position_encoding.py``; DETR sec. 3.2 / Deformable DETR sec. 4.1 for the multi-scale features).

Parameter names follow upstream: the ``Joiner`` is an ``nn.Sequential`` whose item 0 is the ResNet wrapper
(``backbone.0.body.<torchvision resnet name>``, e.g. ``backbone.0.body.layer4.2.conv3.weight``) and item 1 the
position encoding (no parameters).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.ops.misc import FrozenBatchNorm2d

# Output channels of layer1..layer4 per ResNet depth.
RESNET_CHANNELS = {
    "resnet18": (64, 128, 256, 512),
    "resnet34": (64, 128, 256, 512),
    "resnet50": (256, 512, 1024, 2048),
    "resnet101": (256, 512, 1024, 2048),
}


def downsample_mask(mask: Tensor, size: tuple[int, int]) -> Tensor:
    """(B, H, W) bool padding mask -> (B, h, w) bool by nearest interpolation (upstream's rule)."""
    return F.interpolate(mask[None].float(), size=size).to(torch.bool)[0]


class PositionEmbeddingSineHW(nn.Module):
    """Normalised 2-D sine position encoding (DETR sec. 3.2 / appendix; DINO's ``PositionEmbeddingSineHW``).

    Positions are the cumulative count of un-padded pixels along y and x, divided by the valid height / width
    and multiplied by ``scale`` (2 pi), so [0, 2 pi] spans the valid image whatever its padding.

    Args:
        num_pos_feats: features per axis (``hidden_dim // 2``); output has ``2 * num_pos_feats`` channels (y then x).
        temperature_h, temperature_w: frequency bases (DINO-4scale: 20 each).
    """

    def __init__(self, num_pos_feats: int = 128, temperature_h: float = 20.0, temperature_w: float = 20.0):
        super().__init__()
        self.num_pos_feats = num_pos_feats
        self.temperature_h = temperature_h
        self.temperature_w = temperature_w
        self.scale = 2 * math.pi

    def forward(self, mask: Tensor) -> Tensor:
        """mask (B, H, W) bool, True on padding -> float32 (B, 2 * num_pos_feats, H, W) (y features, then x; both
        axes in one pass)."""
        not_mask = ~mask
        eps = 1e-6
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        y_embed = y_embed / (y_embed[:, -1:, :] + eps) * self.scale
        x_embed = x_embed / (x_embed[:, :, -1:] + eps) * self.scale
        n = self.num_pos_feats
        idx = torch.div(torch.arange(n, dtype=torch.float32, device=mask.device), 2, rounding_mode="floor")
        dim_t = torch.stack([self.temperature_h ** (2 * idx / n), self.temperature_w ** (2 * idx / n)])  # (2, n)
        pos = torch.stack([y_embed, x_embed], -1)[..., None] / dim_t  # (B, H, W, 2, n)
        pos = torch.stack((pos[..., 0::2].sin(), pos[..., 1::2].cos()), dim=-1).flatten(-3)
        return pos.permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return f"num_pos_feats={self.num_pos_feats}, temperature=({self.temperature_h}, {self.temperature_w})"


class Backbone(nn.Module):
    """torchvision ResNet with ``FrozenBatchNorm2d``; returns the layers named by ``return_interm_indices``.

    Upstream ``Backbone``/``BackboneBase``: with ``train_backbone`` only layer2..layer4 train (conv1, bn1, layer1
    frozen); ``return_interm_indices`` (1, 2, 3) returns layer2, layer3, layer4 (strides 8, 16, 32).

    Args:
        name: resnet18 / resnet34 / resnet50 / resnet101 (upstream allows 50 and 101 only).
        train_backbone: False freezes every parameter.
        dilation: dilate layer4 (stride 16 instead of 32; the DC5 variant).
        return_interm_indices: ResNet stages to return, 0 = layer1 .. 3 = layer4.
        pretrained: path of a local torchvision ResNet ``state_dict`` file (``torch.save(resnet.state_dict())``,
            or ``{"model": state_dict}``) loaded with ``strict=True``; None keeps the random init (no download
            ever happens here).

    Raises:
        ValueError: unknown ``name``.
        ConfigError: ``pretrained_backbone: ...`` naming the file: unreadable, not a dict of tensors, or keys /
            shapes that are not this ResNet's (e.g. a ResNet-50 file for resnet18, a whole DINO checkpoint).
    """

    def __init__(
        self,
        name: str,
        train_backbone: bool = True,
        dilation: bool = False,
        return_interm_indices: tuple[int, ...] = (1, 2, 3),
        pretrained: str | None = None,
    ):
        super().__init__()
        if name not in RESNET_CHANNELS:
            raise ValueError(f"Backbone: unknown ResNet {name!r}; choose one of {sorted(RESNET_CHANNELS)}")
        resnet = getattr(torchvision.models, name)(
            weights=None, replace_stride_with_dilation=[False, False, dilation], norm_layer=FrozenBatchNorm2d
        )
        if pretrained:
            from trainer.models.local_weights import load_checked, read_state_dict

            state = read_state_dict(pretrained, "pretrained_backbone", unwrap=("model",))
            # FrozenBatchNorm2d keeps no num_batches_tracked (torchvision drops it when loading, as here)
            state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
            load_checked(resnet, state, pretrained, "pretrained_backbone", f"a torchvision {name}")
        for pname, p in resnet.named_parameters():
            if not train_backbone or not any(k in pname for k in ("layer2", "layer3", "layer4")):
                p.requires_grad_(False)
        n = len(return_interm_indices)
        return_layers = {f"layer{5 - n + i}": str(idx) for i, idx in enumerate(return_interm_indices)}
        self.body = IntermediateLayerGetter(resnet, return_layers=return_layers)
        self.num_channels = list(RESNET_CHANNELS[name][4 - n :])
        self.strides = [2 ** (k + 2) for k in range(4 - n, 4)]
        if dilation:
            self.strides[-1] //= 2

    def forward(self, images: Tensor, mask: Tensor) -> list[tuple[Tensor, Tensor]]:
        """images (B, 3, H, W), mask (B, H, W) bool -> [(features (B, C_l, H_l, W_l), mask (B, H_l, W_l) bool)]."""
        out = []
        for x in self.body(images).values():
            out.append((x, downsample_mask(mask, x.shape[-2:])))
        return out


class Joiner(nn.Sequential):
    """``Joiner(backbone, position_embedding)``: item 0 the ResNet, item 1 the position encoding (upstream layout).

    ``forward(images, mask)`` returns (features, masks, positions), lists over the backbone levels; positions are
    cast to the features' dtype as upstream.
    """

    def __init__(self, backbone: Backbone, position_embedding: PositionEmbeddingSineHW):
        super().__init__(backbone, position_embedding)
        self.num_channels = backbone.num_channels

    def forward(self, images: Tensor, mask: Tensor) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        feats, masks, poss = [], [], []
        for x, m in self[0](images, mask):
            feats.append(x)
            masks.append(m)
            poss.append(self[1](m).to(x.dtype))
        return feats, masks, poss


def build_backbone(cfg) -> Joiner:
    """The ``backbone`` module of :class:`~trainer.models.dino.model.DINO` from a :class:`DinoConfig`."""
    body = Backbone(
        cfg.backbone,
        train_backbone=cfg.lr_backbone > 0,
        dilation=cfg.dilation,
        return_interm_indices=tuple(cfg.return_interm_indices),
        pretrained=cfg.pretrained,
    )
    pos = PositionEmbeddingSineHW(cfg.hidden_dim // 2, cfg.pe_temperature, cfg.pe_temperature)
    return Joiner(body, pos)
