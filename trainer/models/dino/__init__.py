"""DINO-4scale detector (Zhang et al. 2022, arXiv 2203.03605) on :mod:`trainer.ops.msda`.

Written from the paper and upstream IDEA-Research/DINO's structure, defaults, names and initialisation (read as
facts, not copied). :func:`build_dino` ``(cfg, num_classes)`` builds :class:`DINO`; :class:`DinoConfig` holds the
DINO-4scale defaults (each with its line in upstream ``config/DINO/DINO_4scale.py``).

Modules: ``config`` (DinoConfig), ``backbone`` (ResNet + FrozenBatchNorm2d + sine encoding), ``attention``
(MSDeformAttn with projections), ``transformer`` (encoder, mixed query selection, decoder), ``dn`` (contrastive
denoising), ``model`` (DINO, build_dino), ``utils`` (MLP, inverse_sigmoid, sine embedding, proposals).

State-dict names follow upstream ``checkpoint0011_4scale.pth``: ``backbone.0.body.*`` (torchvision ResNet keys),
``input_proj.<l>.{0,1}.*``, ``transformer.level_embed``, ``transformer.encoder.layers.<i>.{self_attn.{
sampling_offsets,attention_weights,value_proj,output_proj},norm1,linear1,linear2,norm2}.*``,
``transformer.decoder.layers.<i>.{cross_attn.*,norm1,self_attn.{in_proj_weight,in_proj_bias,out_proj.*},norm2,
linear1,linear2,norm3}``, ``transformer.decoder.{norm,ref_point_head.layers.<j>}.*``,
``transformer.decoder.{bbox_embed,class_embed}.<i>.*`` (the model's heads, shared), ``transformer.tgt_embed.weight``,
``transformer.enc_output.*``, ``transformer.enc_output_norm.*``, ``transformer.enc_out_{class,bbox}_embed.*``,
``class_embed.<i>.*``, ``bbox_embed.<i>.layers.<j>.*``, ``label_enc.weight``.

Names / shapes that differ from upstream (for the checkpoint name map):

- none of the parameter or buffer names differ. Buffers: ``FrozenBatchNorm2d`` is torchvision's (same buffers
  ``weight``, ``bias``, ``running_mean``, ``running_var``; eps 1e-5 as upstream's).
- ``label_enc.weight`` has ``num_classes + 1`` rows (upstream ``dn_labelbook_size + 1``; equal for COCO's 91).
- no other state: upstream's ``backbone.1`` (position encoding) has no parameters, nor has ours.

Behaviour that differs from upstream (see each docstring): batch-first tensors inside the transformer;
``gen_sineembed_for_position`` uses ``hidden_dim // 2`` features per coordinate (upstream hard-codes 128, the
same at hidden_dim 256); lr_backbone = 0 freezes the backbone instead of raising; ``dn_meta`` always carries
"output_known_lbs_bboxes" when denoising ran, with 0 rows for a batch without boxes (upstream omits the key);
labels >= num_classes raise ValueError; fewer encoder tokens than ``num_queries`` raise ValueError.
"""

from trainer.models.dino.config import DinoConfig
from trainer.models.dino.model import DINO, build_dino

__all__ = ["DINO", "DinoConfig", "build_dino"]
