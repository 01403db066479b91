"""DINO's deformable transformer (Zhang et al. 2022, arXiv 2203.03605; upstream ``deformable_transformer.py``).

- Encoder (Deformable DETR sec. 4.1): ``enc_layers`` post-norm layers of multi-scale deformable self-attention
  + FFN over the flattened multi-scale tokens, each token's reference point its own pixel centre.
- Mixed query selection (DINO sec. 3.3, two-stage "standard"): every encoder token proposes a box
  (``enc_output`` + ``enc_output_norm``, then ``enc_out_class_embed`` / ``enc_out_bbox_embed``); the top
  ``num_queries`` by best class logit become the (detached) anchor boxes, while the content queries are the
  learned ``tgt_embed`` (not the selected features).
- Decoder (DINO sec. 3.4 and DAB-DETR): self-attention (with the denoising mask) -> deformable cross-attention
  at the anchor boxes -> FFN, each post-norm; query positional embedding ``ref_point_head(sine(anchor))``; each
  layer refines its anchor with the shared ``bbox_embed`` (look forward twice, see :class:`TransformerDecoder`).

All tensors are batch-first here (upstream's decoder is sequence-first); parameter names are upstream's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.models.dino.attention import MSDeformAttn
from trainer.models.dino.utils import (
    MLP,
    gen_encoder_output_proposals,
    gen_sineembed_for_position,
    has_values,
    inverse_sigmoid,
    level_shapes,
    symbolic,
)


def _scalar(n, like: Tensor) -> Tensor:
    """An int64 0-d tensor of ``n`` (a Python int or a ``torch.SymInt``) on ``like``'s device."""
    return torch.full((), n, dtype=torch.long, device=like.device)


class DeformableTransformerEncoderLayer(nn.Module):
    """Post-norm encoder layer: ``norm1(src + self_attn(src + pos))`` then ``norm2(x + linear2(relu(linear1(x))))``."""

    def __init__(self, d_model=256, d_ffn=1024, dropout=0.0, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.self_attn = MSDeformAttn(d_model, n_levels, n_heads, n_points)
        self.dropout1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, d_ffn)
        self.dropout2 = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ffn, d_model)
        self.dropout3 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(
        self, src, pos, reference_points, spatial_shapes, level_start_index, key_padding_mask=None, level_shapes=None
    ):
        """src, pos (B, S, C); reference_points (B, S, L, 2); key_padding_mask (B, S) bool; level_shapes: the
        spatial_shapes as Python ints or None -> (B, S, C)."""
        src2 = self.self_attn(
            src + pos, reference_points, src, spatial_shapes, level_start_index, key_padding_mask, level_shapes
        )
        src = self.norm1(src + self.dropout1(src2))
        src2 = self.linear2(self.dropout2(F.relu(self.linear1(src))))
        return self.norm2(src + self.dropout3(src2))


class DeformableTransformerDecoderLayer(nn.Module):
    """Post-norm decoder layer in upstream's order sa -> ca -> ffn (norm2, norm1, norm3 respectively)."""

    def __init__(self, d_model=256, d_ffn=1024, dropout=0.0, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        self.cross_attn = MSDeformAttn(d_model, n_levels, n_heads, n_points)
        self.dropout1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.dropout2 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, d_ffn)
        self.dropout3 = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ffn, d_model)
        self.dropout4 = nn.Dropout(dropout)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(
        self,
        tgt,
        query_pos,
        reference_points,
        memory,
        memory_mask,
        level_start_index,
        spatial_shapes,
        attn_mask,
        level_shapes=None,
    ):
        """tgt, query_pos (B, Q, C); reference_points (B, Q, L, 4); memory (B, S, C); memory_mask (B, S) bool;
        attn_mask (Q, Q) bool (True = may not attend) or None; level_shapes as the encoder's -> (B, Q, C)."""
        q = k = tgt + query_pos
        tgt2 = self.self_attn(q, k, tgt, attn_mask=attn_mask, need_weights=False)[0]
        tgt = self.norm2(tgt + self.dropout2(tgt2))
        tgt2 = self.cross_attn(
            tgt + query_pos, reference_points, memory, spatial_shapes, level_start_index, memory_mask, level_shapes
        )
        tgt = self.norm1(tgt + self.dropout1(tgt2))
        tgt2 = self.linear2(self.dropout3(F.relu(self.linear1(tgt))))
        return self.norm3(tgt + self.dropout4(tgt2))


class TransformerEncoder(nn.Module):
    """``num_layers`` deep copies of the encoder layer (``encoder.layers.<i>``)."""

    def __init__(self, layer: DeformableTransformerEncoderLayer, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))

    @staticmethod
    def get_reference_points(spatial_shapes, valid_ratios: Tensor) -> Tensor:
        """Pixel centres of every level, normalised by the valid size, seen from every level: (B, S, L, 2) (x, y).
        ``spatial_shapes``: (L, 2) int64 tensor or (H, W) pairs of Python ints."""
        refs = []
        for lvl, (h, w) in enumerate(level_shapes(spatial_shapes)):
            ys, xs = torch.meshgrid(
                torch.arange(h, dtype=torch.float32, device=valid_ratios.device) + 0.5,
                torch.arange(w, dtype=torch.float32, device=valid_ratios.device) + 0.5,
                indexing="ij",
            )
            ref_y = ys.reshape(-1)[None] / (valid_ratios[:, None, lvl, 1] * h)
            ref_x = xs.reshape(-1)[None] / (valid_ratios[:, None, lvl, 0] * w)
            refs.append(torch.stack((ref_x, ref_y), -1))
        return torch.cat(refs, 1)[:, :, None] * valid_ratios[:, None]

    def forward(self, src, pos, spatial_shapes, level_start_index, valid_ratios, key_padding_mask, level_shapes=None):
        """src, pos (B, S, C); valid_ratios (B, L, 2) (w, h); key_padding_mask (B, S); level_shapes: the
        spatial_shapes as Python ints or None -> memory (B, S, C)."""
        reference_points = self.get_reference_points(
            spatial_shapes if level_shapes is None else level_shapes, valid_ratios
        )
        out = src
        for layer in self.layers:
            out = layer(out, pos, reference_points, spatial_shapes, level_start_index, key_padding_mask, level_shapes)
        return out


class TransformerDecoder(nn.Module):
    """Decoder with iterative anchor refinement, "look forward twice" (DINO sec. 3.5).

    Layer i takes the anchors b_{i-1} (detached) and outputs h_i; the refined anchor is
    ``b_i = sigmoid(bbox_embed[i](h_i) + inverse_sigmoid(b_{i-1}.detach()))``. The next layer gets
    ``b_i.detach()``, while ``references`` keeps the un-detached ``b_i``: the model predicts layer i+1's boxes as
    ``sigmoid(bbox_embed[i+1](norm(h_{i+1})) + inverse_sigmoid(b_i))``, so layer i+1's box loss also updates
    layer i's box head ("forward twice"). As upstream, the refinement here uses the un-normalised h_i, the
    predictions the ``norm``-ed one.

    ``bbox_embed`` / ``class_embed`` are the model's ModuleLists, attached by :class:`~.model.DINO` (upstream).
    """

    def __init__(self, layer: DeformableTransformerDecoderLayer, num_layers: int, d_model: int):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
        self.num_layers = num_layers
        self.norm = nn.LayerNorm(d_model)
        self.d_model = d_model
        self.ref_point_head = MLP(2 * d_model, d_model, d_model, 2)
        self.bbox_embed: nn.ModuleList | None = None
        self.class_embed: nn.ModuleList | None = None

    def forward(
        self,
        tgt,
        memory,
        memory_mask,
        pos,
        refpoints_unsigmoid,
        level_start_index,
        spatial_shapes,
        valid_ratios,
        attn_mask=None,
        level_shapes=None,
    ):
        """tgt (B, Q, C) content queries; refpoints_unsigmoid (B, Q, 4) anchors in inverse-sigmoid space;
        level_shapes: the spatial_shapes as Python ints or None.

        Returns (hs, references): hs (n_dec, B, Q, C) normed layer outputs, references (n_dec + 1, B, Q, 4)
        sigmoid anchors (index 0 the input anchors, index i+1 layer i's un-detached refinement).
        """
        output = tgt
        reference_points = refpoints_unsigmoid.sigmoid()
        references, hs = [reference_points], []
        ratios = torch.cat([valid_ratios, valid_ratios], -1)[:, None]  # (B, 1, L, 4)
        for lid, layer in enumerate(self.layers):
            ref_input = reference_points[:, :, None] * ratios  # (B, Q, L, 4)
            query_sine_embed = gen_sineembed_for_position(ref_input[:, :, 0, :], self.d_model)
            query_pos = self.ref_point_head(query_sine_embed)
            output = layer(
                output,
                query_pos,
                ref_input,
                memory,
                memory_mask,
                level_start_index,
                spatial_shapes,
                attn_mask,
                level_shapes,
            )
            new_reference_points = (self.bbox_embed[lid](output) + inverse_sigmoid(reference_points)).sigmoid()
            reference_points = new_reference_points.detach()
            references.append(new_reference_points)
            hs.append(self.norm(output))
        return torch.stack(hs), torch.stack(references)


class DeformableTransformer(nn.Module):
    """Encoder, mixed query selection and decoder of DINO (module names as upstream ``DeformableTransformer``).

    Parameters: ``level_embed`` (L, C), ``encoder``, ``decoder``, ``tgt_embed`` (num_queries, C), ``enc_output``,
    ``enc_output_norm``; ``enc_out_class_embed`` / ``enc_out_bbox_embed`` are attached by the model.
    Initialisation as upstream: Xavier-uniform on every matrix, then each ``MSDeformAttn``'s own init, then
    ``level_embed`` normal(0, 1).
    """

    def __init__(
        self,
        d_model=256,
        nhead=8,
        num_queries=900,
        num_encoder_layers=6,
        num_decoder_layers=6,
        dim_feedforward=2048,
        dropout=0.0,
        num_feature_levels=4,
        enc_n_points=4,
        dec_n_points=4,
    ):
        super().__init__()
        self.d_model, self.nhead, self.num_queries = d_model, nhead, num_queries
        self.num_feature_levels = num_feature_levels
        self.num_decoder_layers = num_decoder_layers
        enc_layer = DeformableTransformerEncoderLayer(
            d_model, dim_feedforward, dropout, num_feature_levels, nhead, enc_n_points
        )
        self.encoder = TransformerEncoder(enc_layer, num_encoder_layers)
        dec_layer = DeformableTransformerDecoderLayer(
            d_model, dim_feedforward, dropout, num_feature_levels, nhead, dec_n_points
        )
        self.decoder = TransformerDecoder(dec_layer, num_decoder_layers, d_model)
        self.level_embed = nn.Parameter(torch.empty(num_feature_levels, d_model))
        self._level_tensors: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.tgt_embed = nn.Embedding(num_queries, d_model)
        self.enc_output = nn.Linear(d_model, d_model)
        self.enc_output_norm = nn.LayerNorm(d_model)
        self.enc_out_class_embed: nn.Module | None = None
        self.enc_out_bbox_embed: nn.Module | None = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        for m in self.modules():
            if isinstance(m, MSDeformAttn):
                m._reset_parameters()
        nn.init.normal_(self.level_embed)

    def level_tensors(self, shapes: list[tuple[int, int]], like: Tensor) -> tuple[Tensor, Tensor]:
        """``spatial_shapes`` (L, 2) and ``level_start_index`` (L,) int64 on ``like``'s device for the levels'
        (H_l, W_l) ints. Made once per shapes and device and kept: a host-to-device copy inside a step would stop
        CUDA graph capture (``cuda_graphs``) and costs a copy per step otherwise. Made outside inference mode, so a
        shape first seen in an ``inference_mode`` evaluation still serves training. Shape-only tensors (meta, fake:
        the memory prediction) get fresh ones, never kept."""
        keep = has_values(like) and not symbolic(shapes)
        key = (tuple(shapes), str(like.device)) if keep else None
        if keep and key in self._level_tensors:
            return self._level_tensors[key]
        starts = [sum(h * w for h, w in shapes[:i]) for i in range(len(shapes))]
        with torch.inference_mode(False):  # kept tensors must serve a later training step's backward too
            if symbolic(shapes):  # torch.export, dynamic H and W: traced scalars, not constants (as_tensor guards)
                made = (
                    torch.stack([torch.stack([_scalar(h, like), _scalar(w, like)]) for h, w in shapes]),
                    torch.stack([_scalar(s, like) for s in starts]),
                )
            else:
                made = (
                    torch.as_tensor(shapes, dtype=torch.long, device=like.device),
                    torch.as_tensor(starts, dtype=torch.long, device=like.device),
                )
        if keep:
            self._level_tensors[key] = made
        return made

    @staticmethod
    def get_valid_ratio(mask: Tensor) -> Tensor:
        """(B, H, W) padding mask -> (B, 2) float32 (valid width / W, valid height / H)."""
        _, h, w = mask.shape
        valid_h = (~mask[:, :, 0]).sum(1).float() / h
        valid_w = (~mask[:, 0, :]).sum(1).float() / w
        return torch.stack([valid_w, valid_h], -1)

    def forward(self, srcs, masks, pos_embeds, refpoint_embed=None, tgt=None, attn_mask=None):
        """Run encoder, query selection and decoder.

        Args:
            srcs: per level (B, C, H_l, W_l) projected features; masks: per level (B, H_l, W_l) bool padding;
            pos_embeds: per level (B, C, H_l, W_l) sine encodings.
            refpoint_embed: (B, pad_size, 4) unsigmoid denoising anchors or None; tgt: (B, pad_size, C) their
                label embeddings or None; attn_mask: (pad_size + num_queries,) * 2 bool or None.

        Returns:
            hs (n_dec, B, pad + Q, C), references (n_dec + 1, B, pad + Q, 4) sigmoid, hs_enc (B, Q, C) selected
            encoder features, ref_enc (B, Q, 4) sigmoid selected proposals refined by ``enc_out_bbox_embed``
            (not detached), init_box_proposal (B, Q, 4) sigmoid raw proposals.
        """
        src_flat, mask_flat, pos_flat, shapes = [], [], [], []
        for lvl, (src, mask, pos) in enumerate(zip(srcs, masks, pos_embeds)):
            shapes.append((src.shape[-2], src.shape[-1]))  # ints; symbolic under torch.export (dynamic H, W)
            src_flat.append(src.flatten(2).transpose(1, 2))
            mask_flat.append(mask.flatten(1))
            pos_flat.append(pos.flatten(2).transpose(1, 2) + self.level_embed[lvl].view(1, 1, -1))
        src_flatten, mask_flatten = torch.cat(src_flat, 1), torch.cat(mask_flat, 1)
        lvl_pos_embed_flatten = torch.cat(pos_flat, 1)
        spatial_shapes, level_start_index = self.level_tensors(shapes, src_flatten)
        valid_ratios = torch.stack([self.get_valid_ratio(m) for m in masks], 1)

        memory = self.encoder(
            src_flatten, lvl_pos_embed_flatten, spatial_shapes, level_start_index, valid_ratios, mask_flatten, shapes
        )

        bs, num_tokens = memory.shape[:2]
        if num_tokens < self.num_queries:
            raise ValueError(
                f"DINO: the image gives {num_tokens} encoder tokens, fewer than num_queries ({self.num_queries}); "
                "use larger images or fewer queries"
            )
        output_memory, output_proposals = gen_encoder_output_proposals(memory, mask_flatten, shapes)
        output_memory = self.enc_output_norm(self.enc_output(output_memory))
        enc_class = self.enc_out_class_embed(output_memory)
        enc_coord_unselected = self.enc_out_bbox_embed(output_memory) + output_proposals  # unsigmoid
        topk = torch.topk(enc_class.max(-1)[0], self.num_queries, dim=1)[1]  # (B, Q)
        refpoint_undetach = torch.gather(enc_coord_unselected, 1, topk.unsqueeze(-1).expand(-1, -1, 4))
        init_box_proposal = torch.gather(output_proposals, 1, topk.unsqueeze(-1).expand(-1, -1, 4)).sigmoid()
        tgt_undetach = torch.gather(output_memory, 1, topk.unsqueeze(-1).expand(-1, -1, self.d_model))
        refpoint_ = refpoint_undetach.detach()
        tgt_ = self.tgt_embed.weight[None].expand(bs, -1, -1)
        if refpoint_embed is not None:
            refpoint_ = torch.cat([refpoint_embed.to(refpoint_.dtype), refpoint_], 1)
            tgt_ = torch.cat([tgt.to(tgt_.dtype), tgt_], 1)

        hs, references = self.decoder(
            tgt_,
            memory,
            mask_flatten,
            lvl_pos_embed_flatten,
            refpoint_,
            level_start_index,
            spatial_shapes,
            valid_ratios,
            attn_mask,
            shapes,
        )
        return hs, references, tgt_undetach, refpoint_undetach.sigmoid(), init_box_proposal
