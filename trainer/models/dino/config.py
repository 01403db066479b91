"""Hyper-parameters of DINO-4scale (Zhang et al. 2022, arXiv 2203.03605) as a dataclass.

Every default is upstream's ``config/DINO/DINO_4scale.py`` (IDEA-Research/DINO, commit 67bbcd9, 2,456 characters)
line by line; ``L<n>`` below is the line of that file:

============================  =========  ======  ===================================================================
field                         default    line    upstream name / note
============================  =========  ======  ===================================================================
backbone                      resnet50   L25     ``backbone``; resnet18/34 accepted here too (upstream asserts 50/101)
dilation                      False      L28     ``dilation`` (dilated layer4: DC5 variant)
return_interm_indices         (1, 2, 3)  L32     ``return_interm_indices``: layer2..layer4, strides 8, 16, 32
lr_backbone                   1e-5       L7      ``lr_backbone``; > 0 trains layer2..4 (``BackboneBase``), 0 freezes all
pe_temperature                20         L30-31  ``pe_temperatureH`` = ``pe_temperatureW`` (one value here)
hidden_dim                    256        L39     ``hidden_dim`` (d_model)
dim_feedforward               2048       L38     ``dim_feedforward``
nheads                        8          L41     ``nheads``
enc_layers                    6          L34     ``enc_layers``
dec_layers                    6          L35     ``dec_layers``
dropout                       0.0        L40     ``dropout``
num_feature_levels            4          L55     ``num_feature_levels`` (3 backbone levels + 1 stride-2 conv)
enc_n_points                  4          L56     ``enc_n_points``
dec_n_points                  4          L57     ``dec_n_points``
num_queries                   900        L42     ``num_queries`` (top-k encoder proposals = decoder queries)
num_select                    300        L71     ``num_select`` (post-processing top-k; not used by the model)
two_stage_type                standard   L63     ``two_stage_type`` (only "standard" is implemented)
dec_pred_bbox_embed_share     True       L94     ``dec_pred_bbox_embed_share``
dec_pred_class_embed_share    True       L95     ``dec_pred_class_embed_share``
two_stage_bbox_embed_share    False      L66     ``two_stage_bbox_embed_share``
two_stage_class_embed_share   False      L67     ``two_stage_class_embed_share``
dn_number                     100        L99     ``dn_number`` (``use_dn = True`` L98; 0 disables denoising)
dn_box_noise_scale            0.4        L100    ``dn_box_noise_scale``
dn_label_noise_ratio          0.5        L101    ``dn_label_noise_ratio``
aux_loss                      True       L75     ``aux_loss``
focal_alpha                   0.25       L87     ``focal_alpha`` (criterion)
set_cost_class/bbox/giou      2, 5, 2    L76-78  matcher costs (criterion engineer's)
cls/bbox/giou_loss_coef       1, 5, 2    L79-83  loss weights (criterion engineer's)
interm_loss_coef              1.0        L85     ``interm_loss_coef``
============================  =========  ======  ===================================================================

Fixed in this implementation (upstream values, not options): ``pre_norm = False`` (L37, post-norm layers),
``transformer_activation = 'relu'`` (L72), ``batch_norm_type = 'FrozenBatchNorm2d'`` (L73), ``query_dim = 4``
(L43), ``decoder_sa_type = 'sa'`` (L89), ``decoder_module_seq = ['sa', 'ca', 'ffn']`` (L91),
``embed_init_tgt = True`` (L102, learned content queries), ``two_stage_default_hw = 0.05`` (L69),
``use_detached_boxes_dec_out = False`` (L112), ``position_embedding = 'sine'`` (L29). ``dn_labelbook_size``
(L103, 91 = COCO's num_classes) is always ``num_classes`` here, so ``label_enc`` has ``num_classes + 1`` rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

BACKBONES = ("resnet18", "resnet34", "resnet50", "resnet101")


@dataclass
class DinoConfig:
    """DINO-4scale hyper-parameters; defaults are upstream's (see the module docstring for each source line)."""

    backbone: str = "resnet50"
    dilation: bool = False
    return_interm_indices: tuple[int, ...] = (1, 2, 3)
    lr_backbone: float = 1e-5
    pretrained: str | None = None  # local torchvision ResNet state_dict file (.pth); None: random init
    pe_temperature: float = 20.0
    hidden_dim: int = 256
    dim_feedforward: int = 2048
    nheads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    dropout: float = 0.0
    num_feature_levels: int = 4
    enc_n_points: int = 4
    dec_n_points: int = 4
    num_queries: int = 900
    num_select: int = 300
    two_stage_type: str = "standard"
    dec_pred_bbox_embed_share: bool = True
    dec_pred_class_embed_share: bool = True
    two_stage_bbox_embed_share: bool = False
    two_stage_class_embed_share: bool = False
    dn_number: int = 100
    dn_box_noise_scale: float = 0.4
    dn_label_noise_ratio: float = 0.5
    dn_max_boxes: int = 0
    aux_loss: bool = True
    focal_alpha: float = 0.25
    set_cost_class: float = 2.0
    set_cost_bbox: float = 5.0
    set_cost_giou: float = 2.0
    cls_loss_coef: float = 1.0
    bbox_loss_coef: float = 5.0
    giou_loss_coef: float = 2.0
    interm_loss_coef: float = 1.0

    def __post_init__(self) -> None:
        self.return_interm_indices = tuple(int(i) for i in self.return_interm_indices)
        self.validate()

    def level_strides(self) -> list[int]:
        """Stride in pixels of each feature level the transformer sees: the backbone's returned layers (ResNet
        layer k has stride 2**(k + 1); ``dilation`` halves the last), then one stride-2 conv per extra level up to
        ``num_feature_levels`` (Deformable DETR sec. 4.1). DINO-4scale: [8, 16, 32, 64]. A level's grid is
        ceil(side / stride), so an image side must exceed the last stride for every level to be at least 2
        wide (the exported graph's smallest side: :mod:`trainer.tasks.detection.export`)."""
        n = len(self.return_interm_indices)
        strides = [2 ** (k + 2) for k in range(4 - n, 4)]
        if self.dilation:
            strides[-1] //= 2
        for _ in range(self.num_feature_levels - n):
            strides.append(strides[-1] * 2)
        return strides

    def validate(self) -> None:
        """Raise ValueError naming the field when a value cannot build a model."""
        if self.backbone not in BACKBONES:
            raise ValueError(f"DinoConfig.backbone must be one of {BACKBONES}, got {self.backbone!r}")
        if self.return_interm_indices not in ((1, 2, 3), (0, 1, 2, 3), (3,)):
            raise ValueError(
                f"DinoConfig.return_interm_indices must be (1, 2, 3), (0, 1, 2, 3) or (3,) (upstream's choices), "
                f"got {self.return_interm_indices}"
            )
        if self.num_feature_levels < len(self.return_interm_indices):
            raise ValueError(
                f"DinoConfig.num_feature_levels ({self.num_feature_levels}) must be >= the number of backbone "
                f"levels ({len(self.return_interm_indices)})"
            )
        if self.two_stage_type != "standard":
            raise ValueError(f"DinoConfig.two_stage_type: only 'standard' is implemented, got {self.two_stage_type!r}")
        if self.hidden_dim % self.nheads or self.hidden_dim % 32 or self.hidden_dim % 4:
            raise ValueError(
                f"DinoConfig.hidden_dim ({self.hidden_dim}) must be divisible by nheads ({self.nheads}) and by 32 "
                "(GroupNorm(32, hidden_dim) in input_proj)"
            )
        for name in ("enc_layers", "dec_layers", "num_queries", "enc_n_points", "dec_n_points", "dim_feedforward"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DinoConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dn_number < 0:
            raise ValueError(f"DinoConfig.dn_number must be >= 0, got {self.dn_number}")
        if self.dn_max_boxes < 0:
            raise ValueError(f"DinoConfig.dn_max_boxes must be >= 0, got {self.dn_max_boxes}")
        if not 0.0 <= self.dn_label_noise_ratio <= 1.0 or self.dn_box_noise_scale < 0:
            raise ValueError(
                "DinoConfig.dn_label_noise_ratio must be in [0, 1] and dn_box_noise_scale >= 0, got "
                f"{self.dn_label_noise_ratio}, {self.dn_box_noise_scale}"
            )
        if self.two_stage_bbox_embed_share or self.two_stage_class_embed_share:
            if not (self.dec_pred_bbox_embed_share and self.dec_pred_class_embed_share):
                raise ValueError(
                    "two_stage_*_embed_share needs dec_pred_bbox_embed_share and dec_pred_class_embed_share"
                )

    def to_dict(self) -> dict:
        return asdict(self)
