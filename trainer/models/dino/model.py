"""The DINO detector (Zhang et al. 2022, arXiv 2203.03605): backbone, input projections, deformable transformer,
prediction heads and contrastive denoising (upstream ``models/dino/dino.py``, class ``DINO``)."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from trainer.models.dino.backbone import Joiner, build_backbone, downsample_mask
from trainer.models.dino.config import DinoConfig
from trainer.models.dino.dn import dn_post_process, prepare_for_cdn
from trainer.models.dino.transformer import DeformableTransformer
from trainer.models.dino.utils import MLP, inverse_sigmoid


class DINO(nn.Module):
    """DINO with mixed query selection, look-forward-twice refinement and contrastive denoising.

    Args:
        backbone: :class:`~trainer.models.dino.backbone.Joiner` (ResNet + sine position encoding).
        transformer: :class:`~trainer.models.dino.transformer.DeformableTransformer`.
        num_classes: classes K; logits have K columns (sigmoid focal classification, no background column).
            Labels must lie in [0, K); ``label_enc`` has K + 1 rows (upstream ``dn_labelbook_size + 1``).
        cfg: the :class:`DinoConfig` (dn settings, head sharing, ``aux_loss``).

    Modules (upstream names): ``backbone``, ``input_proj`` (per level Conv2d + GroupNorm(32); the levels past the
    backbone's are 3x3 stride-2 convs, Deformable DETR sec. 4.1), ``transformer``, ``label_enc``,
    ``class_embed`` / ``bbox_embed`` (one per decoder layer, the same module when shared), and the transformer's
    ``enc_out_class_embed`` / ``enc_out_bbox_embed`` (copies unless ``two_stage_*_embed_share``).
    """

    def __init__(self, backbone: Joiner, transformer: DeformableTransformer, num_classes: int, cfg: DinoConfig):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"DINO: num_classes must be >= 1, got {num_classes}")
        self.cfg = cfg
        self.num_classes = num_classes
        self.num_queries = cfg.num_queries
        self.hidden_dim = hidden_dim = transformer.d_model
        self.num_feature_levels = cfg.num_feature_levels
        self.aux_loss = cfg.aux_loss
        self.dn_number = cfg.dn_number
        self.dn_box_noise_scale = cfg.dn_box_noise_scale
        self.dn_label_noise_ratio = cfg.dn_label_noise_ratio
        self.dn_max_boxes = cfg.dn_max_boxes
        self.label_enc = nn.Embedding(num_classes + 1, hidden_dim)

        in_channels = backbone.num_channels
        projs = [
            nn.Sequential(nn.Conv2d(c, hidden_dim, kernel_size=1), nn.GroupNorm(32, hidden_dim)) for c in in_channels
        ]
        c = in_channels[-1]
        for _ in range(cfg.num_feature_levels - len(in_channels)):
            projs.append(
                nn.Sequential(
                    nn.Conv2d(c, hidden_dim, kernel_size=3, stride=2, padding=1), nn.GroupNorm(32, hidden_dim)
                )
            )
            c = hidden_dim
        self.input_proj = nn.ModuleList(projs)
        self.backbone = backbone
        self.transformer = transformer

        _class_embed = nn.Linear(hidden_dim, num_classes)
        _bbox_embed = MLP(hidden_dim, hidden_dim, 4, 3)
        prior_prob = 0.01
        nn.init.constant_(_class_embed.bias, -math.log((1 - prior_prob) / prior_prob))
        nn.init.zeros_(_bbox_embed.layers[-1].weight)
        nn.init.zeros_(_bbox_embed.layers[-1].bias)
        n_dec = transformer.num_decoder_layers
        share_box, share_cls = cfg.dec_pred_bbox_embed_share, cfg.dec_pred_class_embed_share
        self.bbox_embed = nn.ModuleList(_bbox_embed if share_box else copy.deepcopy(_bbox_embed) for _ in range(n_dec))
        self.class_embed = nn.ModuleList(
            _class_embed if share_cls else copy.deepcopy(_class_embed) for _ in range(n_dec)
        )
        self.transformer.decoder.bbox_embed = self.bbox_embed
        self.transformer.decoder.class_embed = self.class_embed
        share = cfg.two_stage_bbox_embed_share
        self.transformer.enc_out_bbox_embed = _bbox_embed if share else copy.deepcopy(_bbox_embed)
        share = cfg.two_stage_class_embed_share
        self.transformer.enc_out_class_embed = _class_embed if share else copy.deepcopy(_class_embed)
        for proj in self.input_proj:
            nn.init.xavier_uniform_(proj[0].weight, gain=1)
            nn.init.zeros_(proj[0].bias)

    def _features(self, images: Tensor, mask: Tensor) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Projected multi-scale features, their padding masks and position encodings (one per level)."""
        feats, masks, poss = self.backbone(images, mask)
        srcs = [proj(f) for proj, f in zip(self.input_proj, feats)]
        for lvl in range(len(feats), self.num_feature_levels):
            src = self.input_proj[lvl](feats[-1] if lvl == len(feats) else srcs[-1])
            m = downsample_mask(mask, src.shape[-2:])
            srcs.append(src)
            masks.append(m)
            poss.append(self.backbone[1](m).to(src.dtype))
        return srcs, masks, poss

    def forward(self, images: Tensor, mask: Tensor | None = None, targets: Sequence[dict] | None = None) -> dict:
        """Detect objects.

        Args:
            images: float (B, 3, H, W), normalised (ImageNet mean/std), padded to a common size.
            mask: bool (B, H, W), True on padding; None means no padding.
            targets: training targets, per image {"labels": int64 (N,) in [0, num_classes), "boxes": float (N, 4)
                cx, cy, w, h normalised to [0, 1] of the un-padded image}. Denoising runs only when
                ``self.training`` and targets are given and ``dn_number > 0``.

        Returns:
            {"pred_logits": (B, Q, K) raw logits, "pred_boxes": (B, Q, 4) cxcywh in [0, 1],
            "aux_outputs": [{"pred_logits", "pred_boxes"}] for decoder layers 0..n_dec-2 (with ``aux_loss``),
            "interm_outputs": {"pred_logits" (B, Q, K), "pred_boxes" (B, Q, 4)} of the selected encoder
            proposals, "interm_outputs_for_matching_pre": the same logits with the un-refined proposals,
            "dn_meta": None, or {"pad_size", "num_dn_group", "output_known_lbs_bboxes": {"pred_logits"
            (B, pad, K), "pred_boxes" (B, pad, 4), "aux_outputs"}} when denoising ran}.

        Raises:
            ValueError: a target label outside [0, num_classes); fewer encoder tokens than ``num_queries``.
        """
        if mask is None:
            mask = torch.zeros(images.shape[0], *images.shape[-2:], dtype=torch.bool, device=images.device)
        label, bbox, attn_mask, dn_meta = self.denoising_queries(targets)
        return self.pack(self.dense(images, mask, label, bbox, attn_mask), dn_meta)

    def denoising_queries(
        self, targets: Sequence[dict] | None
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, dict | None]:
        """Contrastive denoising's queries for ``targets`` (:func:`~trainer.models.dino.dn.prepare_for_cdn`):
        (label embeddings (B, pad, C) float, unsigmoid anchors (B, pad, 4) float, attention mask (pad + Q,) * 2
        bool, dn_meta), or four Nones when no denoising runs (eval, no targets, ``dn_number`` 0). Runs eagerly:
        its layout depends on the box counts, read on the host.

        Raises:
            ValueError: a target label outside [0, num_classes).
        """
        if not (self.training and targets is not None and self.dn_number > 0):
            return None, None, None, None
        return prepare_for_cdn(
            targets,
            self.dn_number,
            self.dn_label_noise_ratio,
            self.dn_box_noise_scale,
            self.num_queries,
            self.num_classes,
            self.hidden_dim,
            self.label_enc,
            max_boxes=self.dn_max_boxes,
        )

    def dense(
        self,
        images: Tensor,
        mask: Tensor,
        input_query_label: Tensor | None = None,
        input_query_bbox: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Backbone, encoder, query selection, decoder and heads: tensors in, tensors out, shapes fixed by the
        inputs' shapes, no host read (what ``cuda_graphs`` captures, :mod:`trainer.models.dino.graphs`).

        Args:
            images: float (B, 3, H, W) normalised; mask: bool (B, H, W), True on padding.
            input_query_label, input_query_bbox, attn_mask: :meth:`denoising_queries`' first three (or None).

        Returns:
            outputs_class (n_dec, B, pad + Q, K) raw logits, outputs_coord (n_dec, B, pad + Q, 4) sigmoid cxcywh,
            interm_class (B, Q, K), ref_enc (B, Q, 4) and init_box_proposal (B, Q, 4) of the encoder proposals.

        Raises:
            ValueError: fewer encoder tokens than ``num_queries``.
        """
        srcs, masks, poss = self._features(images, mask)
        hs, reference, hs_enc, ref_enc, init_box_proposal = self.transformer(
            srcs, masks, poss, input_query_bbox, input_query_label, attn_mask
        )
        # keeps label_enc in the graph when no denoising ran (DDP's unused-parameter check), as upstream
        hs = hs + self.label_enc.weight[0, 0] * 0.0

        # look forward twice: layer i's box refines the un-detached box of layer i-1 (reference[i]). With the heads
        # shared across layers (DINO-4scale) every layer goes through them in one call.
        if all(m is self.bbox_embed[0] for m in self.bbox_embed):
            outputs_coord = (self.bbox_embed[0](hs) + inverse_sigmoid(reference[:-1])).sigmoid()
        else:
            outputs_coord = torch.stack(
                [
                    (box_embed(layer_hs) + inverse_sigmoid(layer_ref)).sigmoid()
                    for layer_ref, box_embed, layer_hs in zip(reference[:-1], self.bbox_embed, hs)
                ]
            )
        if all(m is self.class_embed[0] for m in self.class_embed):
            outputs_class = self.class_embed[0](hs)
        else:
            outputs_class = torch.stack([cls_embed(layer_hs) for cls_embed, layer_hs in zip(self.class_embed, hs)])
        interm_class = self.transformer.enc_out_class_embed(hs_enc)
        return outputs_class, outputs_coord, interm_class, ref_enc, init_box_proposal

    def pack(self, dense: Sequence[Tensor], dn_meta: dict | None) -> dict:
        """:meth:`forward`'s dict from :meth:`dense`'s tensors (the denoising rows split off with ``dn_meta``)."""
        outputs_class, outputs_coord, interm_class, ref_enc, init_box_proposal = dense
        if dn_meta is not None:
            outputs_class, outputs_coord = dn_post_process(outputs_class, outputs_coord, dn_meta, self.aux_loss)
        out = {"pred_logits": outputs_class[-1], "pred_boxes": outputs_coord[-1]}
        if self.aux_loss:
            out["aux_outputs"] = [
                {"pred_logits": c, "pred_boxes": b} for c, b in zip(outputs_class[:-1], outputs_coord[:-1])
            ]
        out["interm_outputs"] = {"pred_logits": interm_class, "pred_boxes": ref_enc}
        out["interm_outputs_for_matching_pre"] = {"pred_logits": interm_class, "pred_boxes": init_box_proposal}
        out["dn_meta"] = dn_meta
        return out


def build_dino(cfg: DinoConfig, num_classes: int) -> DINO:
    """DINO for ``num_classes`` classes (labels 0..num_classes-1) from a :class:`DinoConfig`."""
    cfg.validate()
    transformer = DeformableTransformer(
        d_model=cfg.hidden_dim,
        nhead=cfg.nheads,
        num_queries=cfg.num_queries,
        num_encoder_layers=cfg.enc_layers,
        num_decoder_layers=cfg.dec_layers,
        dim_feedforward=cfg.dim_feedforward,
        dropout=cfg.dropout,
        num_feature_levels=cfg.num_feature_levels,
        enc_n_points=cfg.enc_n_points,
        dec_n_points=cfg.dec_n_points,
    )
    return DINO(build_backbone(cfg), transformer, num_classes, cfg)
