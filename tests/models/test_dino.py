"""DINO-4scale model (trainer/models/dino): shapes, denoising, gradients, determinism, bf16, upstream names.

Tiny on CPU: resnet18, hidden 32, FFN 64, 2 encoder / 2 decoder layers, 20 queries, dn_number 4, 2x3x96x128.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from trainer.models.dino import DINO, DinoConfig, build_dino
from trainer.models.dino.attention import MSDeformAttn
from trainer.models.dino.criterion import DinoCriterion, dino_weight_dict
from trainer.models.dino.dn import dn_attention_mask, num_dn_groups, prepare_for_cdn
from trainer.models.dino.matcher import HungarianMatcher

pytestmark = pytest.mark.filterwarnings("ignore:ms_deform_attn. using the PyTorch reference:RuntimeWarning")

K = 5  # classes
TINY = dict(
    backbone="resnet18",
    hidden_dim=32,
    dim_feedforward=64,
    nheads=4,
    enc_layers=2,
    dec_layers=2,
    num_queries=20,
    dn_number=4,
)


def tiny_cfg(**over) -> DinoConfig:
    return DinoConfig(**{**TINY, **over})


def inputs():
    g = torch.Generator().manual_seed(1)
    images = torch.randn(2, 3, 96, 128, generator=g)
    mask = torch.zeros(2, 96, 128, dtype=torch.bool)
    mask[1, 80:, :] = True  # image 1 is 80x104, padded
    mask[1, :, 104:] = True
    targets = [
        {"labels": torch.tensor([1, 4]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.3], [0.3, 0.4, 0.1, 0.1]])},
        {"labels": torch.tensor([0]), "boxes": torch.tensor([[0.6, 0.5, 0.4, 0.4]])},
    ]
    return images, mask, targets


@pytest.fixture(scope="module")
def model() -> DINO:
    torch.manual_seed(0)
    return build_dino(tiny_cfg(), num_classes=K)


def _check_pred(pred: dict, b: int, q: int):
    assert pred["pred_logits"].shape == (b, q, K)
    assert pred["pred_boxes"].shape == (b, q, 4)
    assert torch.isfinite(pred["pred_logits"]).all()
    boxes = pred["pred_boxes"]
    assert ((boxes >= 0) & (boxes <= 1)).all()


def test_output_shapes_and_ranges_train_and_eval(model):
    images, mask, targets = inputs()
    model.train()
    out = model(images, mask, targets)
    _check_pred(out, 2, 20)
    assert len(out["aux_outputs"]) == 1  # dec_layers - 1
    _check_pred(out["aux_outputs"][0], 2, 20)
    _check_pred(out["interm_outputs"], 2, 20)
    model.eval()
    with torch.no_grad():
        out = model(images, mask)
    _check_pred(out, 2, 20)
    _check_pred(out["interm_outputs"], 2, 20)
    assert out["dn_meta"] is None
    with torch.no_grad():  # eval with targets: still no denoising
        assert model(images, mask, targets)["dn_meta"] is None
        assert model(images)["pred_boxes"].shape == (2, 20, 4)  # mask=None: no padding


def test_training_with_targets_gives_dn_outputs_with_pad_size_rows(model):
    images, mask, targets = inputs()
    model.train()
    out = model(images, mask, targets)
    meta = out["dn_meta"]
    groups = num_dn_groups(4, max_gt=2)
    assert groups == 8  # upstream rule: 2 * dn_number groups when 2 * dn_number < 100
    assert meta["num_dn_group"] == groups and meta["pad_size"] == groups * 2 * 2
    dn = meta["output_known_lbs_bboxes"]
    assert dn["pred_logits"].shape == (2, meta["pad_size"], K)
    assert dn["pred_boxes"].shape == (2, meta["pad_size"], 4)
    assert len(dn["aux_outputs"]) == 1 and dn["aux_outputs"][0]["pred_boxes"].shape == (2, meta["pad_size"], 4)
    assert ((dn["pred_boxes"] >= 0) & (dn["pred_boxes"] <= 1)).all()
    assert out["pred_logits"].shape == (2, 20, K)  # matching part only
    # no training targets -> no denoising; targets without boxes -> 0 dn rows
    assert model(images, mask)["dn_meta"] is None
    empty = [{"labels": torch.zeros(0, dtype=torch.long), "boxes": torch.zeros(0, 4)} for _ in range(2)]
    meta = model(images, mask, empty)["dn_meta"]
    assert meta["pad_size"] == 0 and meta["output_known_lbs_bboxes"]["pred_boxes"].shape == (2, 0, 4)


def test_num_dn_groups_upstream_rule():
    assert num_dn_groups(100, 7) == 14  # DINO-4scale: 200 // 14
    assert num_dn_groups(100, 300) == 1  # at least one group
    assert num_dn_groups(100, 0) == 1
    assert num_dn_groups(1, 2) == 2


# 2 groups x (2 positives + 2 negatives) + 3 matching queries; 1 = may not attend.
EXPECTED_MASK = """
00001111000
00001111000
00001111000
00001111000
11110000000
11110000000
11110000000
11110000000
11111111000
11111111000
11111111000
"""


def test_dn_attention_mask_hand_checked():
    expected = torch.tensor([[c == "1" for c in row] for row in EXPECTED_MASK.split()])
    assert torch.equal(dn_attention_mask(num_groups=2, single_pad=2, num_queries=3), expected)
    # the same mask from prepare_for_cdn: dn_number 1 -> 2 groups; 2 boxes in the largest image
    _, _, targets = inputs()
    enc = nn.Embedding(K + 1, 8)
    label, bbox, mask, meta = prepare_for_cdn(targets, 1, 0.5, 0.4, 3, K, 8, enc)
    assert meta == {"pad_size": 8, "num_dn_group": 2, "padded_size": 8, "max_boxes": 0}
    assert torch.equal(mask, expected)
    assert label.shape == (2, 8, 8) and bbox.shape == (2, 8, 4)
    # image 1 has one box: its rows 1, 3, 5, 7 are padding (zero embedding, anchor logit 0)
    assert (label[1, 1::2] == 0).all() and (bbox[1, 1::2] == 0).all()
    assert (label[1, 0::2] != 0).any(-1).all()


def test_dn_box_noise_positives_near_negatives_far():
    boxes = torch.tensor([[0.5, 0.5, 0.4, 0.4]])
    targets = [{"labels": torch.tensor([1]), "boxes": boxes}]
    g = torch.Generator().manual_seed(0)
    _, bbox, _, meta = prepare_for_cdn(targets, 100, 0.0, 0.4, 3, K, 8, nn.Embedding(K + 1, 8), generator=g)
    assert meta["pad_size"] == 200  # 100 groups of (1 positive, 1 negative)
    noisy = bbox[0].sigmoid()
    cxcy, wh = boxes[0, :2], boxes[0, 2:]
    corners = torch.cat([cxcy - wh / 2, cxcy + wh / 2])
    moved = torch.cat([noisy[:, :2] - noisy[:, 2:] / 2, noisy[:, :2] + noisy[:, 2:] / 2], 1) - corners
    limit = 0.4 * torch.cat([wh, wh]) / 2 + 1e-4  # scale * (w/2, h/2) per corner
    assert (moved[0::2].abs() <= limit).all()  # positives: |noise| < 1 * scale * half size
    assert (moved[1::2].abs() >= limit - 2e-4).all()  # negatives: in [1, 2) * scale * half size


def test_label_noise_stays_in_range_and_bad_labels_raise(model):
    one_hot = nn.Embedding(K + 1, K + 1)
    nn.init.eye_(one_hot.weight)
    labels = torch.arange(K).repeat(6)
    targets = [{"labels": labels, "boxes": torch.full((labels.numel(), 4), 0.5)}]
    changed = 0
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        label, _, _, _ = prepare_for_cdn(targets, 100, 1.0, 0.4, 3, K, K + 1, one_hot, generator=g)
        got = label[0].argmax(-1)  # no padding rows here (one image)
        assert (label[0].sum(-1) == 1).all()
        assert int(got.max()) < K
        changed += int((got != labels.repeat(label.shape[1] // labels.numel())).sum())
    assert changed > 0  # noise did act
    # An out-of-range label is clamped for the embedding lookup (no device-side assert, no host sync in the
    # forward); the training step still stops with a clear error, from the criterion's matcher copy.
    images, mask, targets = inputs()
    targets[1]["labels"] = torch.tensor([K])
    model.train()
    out = model(images, mask, targets)
    criterion = DinoCriterion(K, HungarianMatcher(2.0, 5.0, 2.0), dino_weight_dict(model.cfg.dec_layers))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\), got \[\d, 5\]"):
        criterion(out, targets)
    label, _, _, _ = prepare_for_cdn(
        [{"labels": torch.tensor([-1]), "boxes": torch.rand(1, 4)}], 4, 0.0, 0.4, 3, K, K + 1, one_hot
    )
    assert int(label[0, 0].argmax()) == 0  # clamped to class 0
    assert model.label_enc.num_embeddings == K + 1


def test_gradients_reach_backbone_projections_encoder_and_decoder():
    torch.manual_seed(0)
    m = build_dino(tiny_cfg(), num_classes=K).train()
    images, mask, targets = inputs()
    out = m(images, mask, targets)
    dn = out["dn_meta"]["output_known_lbs_bboxes"]
    loss = sum(
        o["pred_logits"].sigmoid().mean() + o["pred_boxes"].mean()
        for o in (out, out["aux_outputs"][0], out["interm_outputs"], dn)
    )
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}

    def reached(prefix: str) -> bool:
        hits = [g for n, g in grads.items() if n.startswith(prefix) and g is not None]
        return bool(hits) and any(g.abs().sum() > 0 for g in hits)

    for prefix in (
        "backbone.0.body.layer4.",
        "input_proj.0.",
        "input_proj.3.",
        "transformer.encoder.layers.0.self_attn.value_proj",
        "transformer.encoder.layers.1.linear1",
        "transformer.enc_output.",
        "transformer.tgt_embed",
        "transformer.decoder.layers.0.self_attn.",
        "transformer.decoder.layers.1.cross_attn.sampling_offsets",
        "transformer.decoder.ref_point_head.",
        "transformer.enc_out_class_embed.",
        "label_enc.",
    ):
        assert reached(prefix), prefix
    # shared heads are listed once by named_parameters (under transformer.decoder.*): check the modules
    assert m.class_embed[0].weight.grad.abs().sum() > 0 and m.bbox_embed[0].layers[-1].weight.grad.abs().sum() > 0
    # level_embed enters only through the zero-initialised sampling_offsets / attention_weights: no gradient yet
    assert m.transformer.level_embed.grad is not None
    frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
    assert "backbone.0.body.conv1.weight" in frozen and all("layer4" not in n for n in frozen)


def test_look_forward_twice_gradient_rule():
    """The last layer's box loss reaches the previous layer's box head (un-detached reference), not earlier."""
    torch.manual_seed(0)
    m = build_dino(tiny_cfg(dec_layers=3, dec_pred_bbox_embed_share=False), num_classes=K).eval()
    images, mask, _ = inputs()
    m(images, mask)["pred_boxes"].sum().backward()
    last = [m.bbox_embed[i].layers[-1].weight.grad for i in range(3)]
    assert last[2].abs().sum() > 0 and last[1].abs().sum() > 0
    assert last[0] is None or last[0].abs().sum() == 0


def test_same_seed_same_outputs():
    images, mask, targets = inputs()
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        m = build_dino(tiny_cfg(), num_classes=K).train()
        outs.append(m(images, mask, targets))
    a, b = outs
    for key in ("pred_logits", "pred_boxes"):
        assert torch.equal(a[key], b[key])
        assert torch.equal(a["interm_outputs"][key], b["interm_outputs"][key])
        assert torch.equal(a["dn_meta"]["output_known_lbs_bboxes"][key], b["dn_meta"]["output_known_lbs_bboxes"][key])


def test_bf16_autocast_on_cpu(model):
    images, mask, targets = inputs()
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images, mask, targets)
    _check_pred(out, 2, 20)
    assert out["pred_logits"].dtype == torch.bfloat16
    (out["pred_logits"].float().mean() + out["pred_boxes"].float().mean()).backward()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _check_pred(model(images, mask), 2, 20)


def test_state_dict_uses_upstream_names(model):
    keys = set(model.state_dict())
    prefixes = (
        "backbone.0.body.",
        "transformer.encoder.layers.",
        "transformer.decoder.layers.",
        "class_embed.",
        "bbox_embed.",
        "input_proj.",
        "transformer.enc_out_class_embed.",
        "transformer.enc_out_bbox_embed.",
        "transformer.decoder.bbox_embed.",
        "transformer.decoder.class_embed.",
        "transformer.decoder.ref_point_head.",
    )
    for prefix in prefixes:
        assert any(k.startswith(prefix) for k in keys), prefix
    for k in (
        "label_enc.weight",
        "transformer.level_embed",
        "transformer.tgt_embed.weight",
        "transformer.enc_output.weight",
        "transformer.enc_output_norm.weight",
        "transformer.encoder.layers.0.self_attn.sampling_offsets.weight",
        "transformer.encoder.layers.1.norm2.bias",
        "transformer.decoder.layers.1.cross_attn.attention_weights.weight",
        "transformer.decoder.layers.0.self_attn.in_proj_weight",
        "transformer.decoder.layers.0.self_attn.out_proj.weight",
        "transformer.decoder.layers.1.norm3.weight",
        "transformer.decoder.norm.weight",
        "input_proj.3.0.weight",
        "input_proj.3.1.weight",
        "backbone.0.body.layer4.1.bn2.running_var",
        "bbox_embed.1.layers.2.weight",
        "class_embed.1.bias",
    ):
        assert k in keys, k
    assert not any(k.startswith("backbone.0.body.fc.") or "num_batches_tracked" in k for k in keys)
    assert model.state_dict()["input_proj.3.0.weight"].shape == (32, 512, 3, 3)  # stride-2 conv on layer4
    # shared heads: one module under every decoder index (dec_pred_*_embed_share), separate encoder heads
    assert model.bbox_embed[0] is model.bbox_embed[1] is model.transformer.decoder.bbox_embed[1]
    assert model.transformer.enc_out_class_embed is not model.class_embed[0]


def test_initialisation_as_upstream(model):
    bias = model.class_embed[0].bias
    assert torch.allclose(bias, torch.full_like(bias, -math.log(99)))
    assert (model.bbox_embed[0].layers[-1].weight == 0).all() and (model.bbox_embed[0].layers[-1].bias == 0).all()
    attn = MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3)
    grid = attn.sampling_offsets.bias.view(4, 2, 3, 2)
    # head directions 0, 90, 180, 270 degrees, point i at distance i + 1, same on every level
    direction = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    for i in range(3):
        assert torch.allclose(grid[:, 0, i], direction * (i + 1), atol=1e-6)
        assert torch.equal(grid[:, 1, i], grid[:, 0, i])
    assert (attn.sampling_offsets.weight == 0).all() and (attn.attention_weights.weight == 0).all()


def test_config_defaults_and_validation():
    cfg = DinoConfig()
    expected = dict(
        num_queries=900,
        num_select=300,
        dn_number=100,
        dn_box_noise_scale=0.4,
        dn_label_noise_ratio=0.5,
        hidden_dim=256,
        dim_feedforward=2048,
        nheads=8,
        enc_layers=6,
        dec_layers=6,
        enc_n_points=4,
        dec_n_points=4,
        num_feature_levels=4,
        two_stage_type="standard",
        dec_pred_bbox_embed_share=True,
        backbone="resnet50",
        return_interm_indices=(1, 2, 3),
        dropout=0.0,
        pe_temperature=20,
        focal_alpha=0.25,
    )
    assert {k: getattr(cfg, k) for k in expected} == expected
    for name in ("resnet18", "resnet34", "resnet50", "resnet101"):
        assert DinoConfig(backbone=name).backbone == name
    with pytest.raises(ValueError, match="backbone"):
        DinoConfig(backbone="resnet152")
    with pytest.raises(ValueError, match="two_stage_type"):
        DinoConfig(two_stage_type="no")
    assert dataclasses.asdict(cfg)["dn_number"] == 100


def test_backbone_loads_a_local_torchvision_state_dict(tmp_path):
    import torchvision

    torch.manual_seed(7)
    reference = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), path)
    m = build_dino(tiny_cfg(pretrained=str(path)), num_classes=K)
    body = m.backbone[0].body
    assert torch.equal(body.layer4[1].conv2.weight, reference.layer4[1].conv2.weight)
    assert torch.equal(body.bn1.running_var, reference.bn1.running_var)


@pytest.mark.parametrize("kind", ["text", "list", "resnet50", "dino_state", "wrapped"])
def test_backbone_file_that_is_not_this_resnet_is_one_config_error(kind, tmp_path):
    """These files raised IndexError / RuntimeError / TypeError from deep inside torch; now one
    ConfigError naming ``pretrained_backbone`` and the file (the CLI prints it as one line, exit 2). A
    ``{"model": state_dict}`` wrapper of the right ResNet loads."""
    import torchvision

    from trainer.errors import ConfigError

    path = tmp_path / f"{kind}.pth"
    if kind == "text":
        path.write_text("not a checkpoint")
    elif kind == "list":
        torch.save([torch.zeros(1)], path)
    elif kind == "resnet50":
        torch.save(torchvision.models.resnet50(weights=None).state_dict(), path)
    elif kind == "dino_state":
        torch.save(build_dino(tiny_cfg(), num_classes=K).state_dict(), path)
    else:
        torch.save({"model": torchvision.models.resnet18(weights=None).state_dict(), "epoch": 3}, path)
        build_dino(tiny_cfg(pretrained=str(path)), num_classes=K)
        return
    expected = {
        "text": "cannot read .* as a state_dict",
        "list": "does not hold a dict of tensors",
        "resnet50": "does not match a torchvision resnet18: .*unexpected keys.*shape mismatches",
        "dino_state": "does not match a torchvision resnet18: .*missing keys.*unexpected keys",
    }[kind]
    with pytest.raises(ConfigError, match=rf"^pretrained_backbone: .*{expected}"):
        build_dino(tiny_cfg(pretrained=str(path)), num_classes=K)


def test_too_few_encoder_tokens_raise():
    m = build_dino(tiny_cfg(num_queries=400), num_classes=K).eval()
    images, mask, _ = inputs()
    with pytest.raises(ValueError, match="num_queries"), torch.no_grad():
        m(images, mask)


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"return_interm_indices": (0, 1, 2, 3), "num_feature_levels": 5},
        {"dilation": True, "backbone": "resnet50"},
        {"num_feature_levels": 3},
    ],
)
def test_level_strides_are_the_feature_maps_strides(over):
    """DinoConfig.level_strides (the exported graph's smallest side comes from it) against the feature maps the
    model makes from a 256 x 512 image."""
    torch.manual_seed(0)
    cfg = tiny_cfg(**over)
    m = build_dino(cfg, num_classes=K).eval()
    with torch.no_grad():
        srcs, _, _ = m._features(torch.zeros(1, 3, 256, 512), torch.zeros(1, 256, 512, dtype=torch.bool))
    assert [(256 // s, 512 // s) for s in cfg.level_strides()] == [tuple(x.shape[-2:]) for x in srcs]
