"""``init_from``: loading upstream DINO checkpoints (trainer/models/dino/weights.py) and through the detection task.

Upstream's names and shapes are written out below from IDEA-Research/DINO's code (models/dino/dino.py: ``DINO``;
deformable_transformer.py: ``DeformableTransformer``, ``TransformerEncoder/Decoder``, the deformable layers;
backbone.py: ``Joiner(Backbone)`` over ``IntermediateLayerGetter`` of a torchvision ResNet with upstream's
``FrozenBatchNorm2d``; ops MSDeformAttn; utils ``MLP``) as built by ``config/DINO/DINO_4scale.py``: the full R50
COCO model is checked name by name and shape by shape against ours (on the meta device), and a tiny variant
(resnet18, hidden 32) with the same structure is the test checkpoint.
"""

from __future__ import annotations

import argparse
import re

import pytest
import torch
from test_dino import TINY

from trainer.config import ConfigError, load_config
from trainer.engine.distributed import DistInfo
from trainer.models.dino import DinoConfig, build_dino
from trainer.models.dino.weights import load_upstream
from trainer.tasks import build_task

pytestmark = pytest.mark.filterwarnings("ignore:ms_deform_attn. using the PyTorch reference:RuntimeWarning")

COCO = 91  # upstream num_classes = dn_labelbook_size for COCO


# .. upstream's state_dict, written out from its code .....................................................
def _frozen_bn(prefix: str, c: int) -> dict:
    # upstream FrozenBatchNorm2d: four buffers, no num_batches_tracked
    return {f"{prefix}.{n}": (c,) for n in ("weight", "bias", "running_mean", "running_var")}


def _resnet_body(name: str) -> tuple[dict, list[int]]:
    """``backbone.0.body.*`` of IntermediateLayerGetter(torchvision resnet, {layer2, layer3, layer4}): conv1, bn1,
    layer1..layer4 (no avgpool/fc); returns the keys and layer2..4's channels (``num_channels``)."""
    blocks = {"resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3], "resnet50": [3, 4, 6, 3], "resnet101": [3, 4, 23, 3]}
    bottleneck = name in ("resnet50", "resnet101")
    exp = 4 if bottleneck else 1
    p = "backbone.0.body"
    out = {f"{p}.conv1.weight": (64, 3, 7, 7), **_frozen_bn(f"{p}.bn1", 64)}
    inplanes, channels = 64, []
    for li, (planes, n) in enumerate(zip((64, 128, 256, 512), blocks[name]), start=1):
        stride = 1 if li == 1 else 2
        for b in range(n):
            q = f"{p}.layer{li}.{b}"
            if bottleneck:
                out[f"{q}.conv1.weight"] = (planes, inplanes, 1, 1)
                out[f"{q}.conv2.weight"] = (planes, planes, 3, 3)
                out[f"{q}.conv3.weight"] = (planes * exp, planes, 1, 1)
                for i, c in ((1, planes), (2, planes), (3, planes * exp)):
                    out.update(_frozen_bn(f"{q}.bn{i}", c))
            else:
                out[f"{q}.conv1.weight"] = (planes, inplanes, 3, 3)
                out[f"{q}.conv2.weight"] = (planes, planes, 3, 3)
                out.update(_frozen_bn(f"{q}.bn1", planes))
                out.update(_frozen_bn(f"{q}.bn2", planes))
            if b == 0 and (stride != 1 or inplanes != planes * exp):
                out[f"{q}.downsample.0.weight"] = (planes * exp, inplanes, 1, 1)
                out.update(_frozen_bn(f"{q}.downsample.1", planes * exp))
            inplanes = planes * exp
        channels.append(planes * exp)
    return out, channels[1:]


def _linear(prefix: str, n_out: int, n_in: int) -> dict:
    return {f"{prefix}.weight": (n_out, n_in), f"{prefix}.bias": (n_out,)}


def _mlp(prefix: str, d_in: int, hidden: int, d_out: int, n: int) -> dict:
    dims = [d_in] + [hidden] * (n - 1)
    out = {}
    for j, (a, b) in enumerate(zip(dims, [hidden] * (n - 1) + [d_out])):
        out.update(_linear(f"{prefix}.layers.{j}", b, a))
    return out


def _msda(prefix: str, h: int, heads: int, levels: int, points: int) -> dict:
    return {
        **_linear(f"{prefix}.sampling_offsets", heads * levels * points * 2, h),
        **_linear(f"{prefix}.attention_weights", heads * levels * points, h),
        **_linear(f"{prefix}.value_proj", h, h),
        **_linear(f"{prefix}.output_proj", h, h),
    }


def _norm(prefix: str, h: int) -> dict:
    return {f"{prefix}.weight": (h,), f"{prefix}.bias": (h,)}


def upstream_shapes(
    num_classes: int = COCO,
    backbone: str = "resnet50",
    hidden_dim: int = 256,
    dim_feedforward: int = 2048,
    nheads: int = 8,
    enc_layers: int = 6,
    dec_layers: int = 6,
    num_queries: int = 900,
    levels: int = 4,
    points: int = 4,
    **_,
) -> dict[str, tuple]:
    """Every key of upstream DINO-4scale's ``model.state_dict()`` with its shape (dn_labelbook_size =
    num_classes, two_stage 'standard', dec_pred_{class,bbox}_embed_share, separate two-stage heads, embed_init_tgt,
    decoder_sa_type 'sa', no pre-norm). Shared heads appear under both ``{bbox,class}_embed.<i>`` and
    ``transformer.decoder.{bbox,class}_embed.<i>``: a module registered twice is saved under both names."""
    h, ffn = hidden_dim, dim_feedforward
    out, channels = _resnet_body(backbone)
    for lvl in range(levels):
        if lvl < len(channels):
            out[f"input_proj.{lvl}.0.weight"] = (h, channels[lvl], 1, 1)
        else:  # 3x3 stride 2 on layer4's output, then on the previous extra level
            out[f"input_proj.{lvl}.0.weight"] = (h, channels[-1] if lvl == len(channels) else h, 3, 3)
        out[f"input_proj.{lvl}.0.bias"] = (h,)
        out.update(_norm(f"input_proj.{lvl}.1", h))
    t = "transformer"
    out[f"{t}.level_embed"] = (levels, h)
    for i in range(enc_layers):
        q = f"{t}.encoder.layers.{i}"
        out.update(_msda(f"{q}.self_attn", h, nheads, levels, points))
        out.update({**_norm(f"{q}.norm1", h), **_linear(f"{q}.linear1", ffn, h), **_linear(f"{q}.linear2", h, ffn)})
        out.update(_norm(f"{q}.norm2", h))
    for i in range(dec_layers):
        q = f"{t}.decoder.layers.{i}"
        out.update(_msda(f"{q}.cross_attn", h, nheads, levels, points))
        out.update(_norm(f"{q}.norm1", h))
        out[f"{q}.self_attn.in_proj_weight"] = (3 * h, h)
        out[f"{q}.self_attn.in_proj_bias"] = (3 * h,)
        out.update(_linear(f"{q}.self_attn.out_proj", h, h))
        out.update({**_norm(f"{q}.norm2", h), **_linear(f"{q}.linear1", ffn, h), **_linear(f"{q}.linear2", h, ffn)})
        out.update(_norm(f"{q}.norm3", h))
    out.update(_norm(f"{t}.decoder.norm", h))
    out.update(_mlp(f"{t}.decoder.ref_point_head", 2 * h, h, h, 2))  # query_dim // 2 * d_model inputs
    out[f"{t}.tgt_embed.weight"] = (num_queries, h)
    out.update({**_linear(f"{t}.enc_output", h, h), **_norm(f"{t}.enc_output_norm", h)})
    out.update(_mlp(f"{t}.enc_out_bbox_embed", h, h, 4, 3))
    out.update(_linear(f"{t}.enc_out_class_embed", num_classes, h))
    for i in range(dec_layers):
        for prefix in ("", f"{t}.decoder."):
            out.update(_mlp(f"{prefix}bbox_embed.{i}", h, h, 4, 3))
            out.update(_linear(f"{prefix}class_embed.{i}", num_classes, h))
    out["label_enc.weight"] = (num_classes + 1, h)  # dn_labelbook_size + 1
    return out


def _shapes(model) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_dino_4scale_r50_coco_has_upstreams_exact_names_and_shapes():
    with torch.device("meta"):
        model = build_dino(DinoConfig(), COCO)
    ours, theirs = _shapes(model), upstream_shapes()
    assert set(ours) - set(theirs) == set() and set(theirs) - set(ours) == set()
    assert ours == theirs
    assert theirs["class_embed.0.weight"] == (91, 256) and theirs["label_enc.weight"] == (92, 256)
    assert theirs["backbone.0.body.layer1.0.conv1.weight"] == (64, 64, 1, 1)
    assert theirs["input_proj.3.0.weight"] == (256, 2048, 3, 3)
    assert "transformer.decoder.bbox_embed.5.layers.2.weight" in theirs and "bbox_embed.5.layers.2.weight" in theirs


# .. the tiny checkpoint ....................................................................................
def tiny(num_classes: int, seed: int, **over):
    torch.manual_seed(seed)
    return build_dino(DinoConfig(**{**TINY, **over}), num_classes)


def save_upstream(path, sd: dict, **extra) -> str:
    """As upstream's main.py saves: model, optimizer, lr_scheduler, epoch, args (an argparse.Namespace)."""
    args = argparse.Namespace(modelname="dino", num_classes=COCO, dn_labelbook_size=COCO, lr=1e-4, dec_layers=2)
    obj = {"model": sd, "optimizer": {"state": {}, "param_groups": []}, "lr_scheduler": {}, "epoch": 11}
    obj["args"] = args
    torch.save({**obj, **extra}, path)
    return str(path)


@pytest.fixture(scope="module")
def coco_sd() -> dict:
    model = tiny(COCO, seed=1)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert _shapes(model) == upstream_shapes(COCO, **TINY)  # the test file is upstream's layout, tiny
    return sd


@pytest.fixture(scope="module")
def coco_ckpt(coco_sd, tmp_path_factory) -> str:
    return save_upstream(tmp_path_factory.mktemp("ckpt") / "checkpoint0011_4scale.pth", coco_sd)


def test_round_trip_loads_every_tensor(coco_sd, coco_ckpt):
    model, lines = tiny(COCO, seed=2), []
    assert not torch.equal(model.state_dict()["transformer.level_embed"], coco_sd["transformer.level_embed"])
    report = load_upstream(model, coco_ckpt, log=lines.append)
    for k, v in model.state_dict().items():
        assert torch.equal(v, coco_sd[k]), k
    n = len(coco_sd)
    assert report.summary() == (
        f"init_from: loaded {n:,} tensors; re-initialised 0; skipped 0; missing 0; unexpected 0"
    )
    assert lines[0] == report.summary()
    assert not any("weights_only=False" in line for line in lines)  # the Namespace loads with weights_only=True
    assert any("epoch 11" in line for line in lines)


def test_91_to_2_classes_reinitialises_class_heads_and_label_enc(coco_sd, coco_ckpt):
    model = tiny(2, seed=3)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    report = load_upstream(model, coco_ckpt, log=lambda s: None)
    heads = {k for k in fresh if re.match(r"(transformer\.decoder\.|transformer\.enc_out_)?class_embed", k)}
    heads.add("label_enc.weight")
    assert len(heads) == 2 * 2 * 2 + 2 + 1
    assert set(report.reinitialised) == heads
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh[k] if k in heads else coco_sd[k]), k
    assert fresh["label_enc.weight"].shape == (3, 32) and coco_sd["label_enc.weight"].shape == (92, 32)
    assert report.summary() == (
        f"init_from: loaded {len(fresh) - len(heads):,} tensors; re-initialised {len(heads)} "
        "(class heads, label_enc: 2 classes vs 91); skipped 0; missing 0; unexpected 0"
    )


def test_ddp_prefix_stripped_and_bare_state_dict_accepted(coco_sd, tmp_path):
    path = tmp_path / "ddp.pth"
    torch.save({f"module.{k}": v for k, v in coco_sd.items()}, path)  # bare, as DDP's model.state_dict()
    model = tiny(COCO, seed=4)
    report = load_upstream(model, path, log=lambda s: None)
    assert len(report.loaded) == len(coco_sd) and not report.missing and not report.unexpected
    assert torch.equal(model.state_dict()["backbone.0.body.conv1.weight"], coco_sd["backbone.0.body.conv1.weight"])


def test_shared_heads_load_from_either_name(coco_sd, tmp_path):
    # a file that lists the shared decoder heads only as transformer.decoder.{bbox,class}_embed.<i> (or only once)
    sd = {k: v for k, v in coco_sd.items() if not re.match(r"(bbox|class)_embed\.", k)}
    sd = {k: v for k, v in sd.items() if not re.match(r"transformer\.decoder\.(bbox|class)_embed\.1\.", k)}
    model = tiny(COCO, seed=5)
    report = load_upstream(model, save_upstream(tmp_path / "one.pth", sd), log=lambda s: None)
    assert len(report.loaded) == len(coco_sd) and not report.missing
    assert torch.equal(model.bbox_embed[1].layers[0].weight, coco_sd["bbox_embed.1.layers.0.weight"])


def test_shape_mismatch_is_skipped_and_reported_missing_and_unexpected_too(coco_sd, tmp_path):
    sd = dict(coco_sd)
    sd["backbone.0.body.conv1.weight"] = torch.zeros(64, 3, 3, 3)
    del sd["transformer.tgt_embed.weight"]
    sd["transformer.refpoint_embed.weight"] = torch.zeros(20, 4)
    model, lines = tiny(COCO, seed=6), []
    before = model.state_dict()["backbone.0.body.conv1.weight"].clone()
    report = load_upstream(model, save_upstream(tmp_path / "bad.pth", sd), log=lines.append)
    assert report.skipped == [("backbone.0.body.conv1.weight", (64, 3, 3, 3), (64, 3, 7, 7))]
    assert report.missing == ["transformer.tgt_embed.weight"]
    assert report.unexpected == ["transformer.refpoint_embed.weight"]
    assert torch.equal(model.state_dict()["backbone.0.body.conv1.weight"], before)
    assert torch.equal(model.state_dict()["transformer.level_embed"], coco_sd["transformer.level_embed"])
    assert "skipped 1; missing 1; unexpected 1" in report.summary()
    text = "\n".join(lines)
    assert "backbone.0.body.conv1.weight (file (64, 3, 3, 3), model (64, 3, 7, 7))" in text
    assert "transformer.tgt_embed.weight" in text and "transformer.refpoint_embed.weight" in text


def test_wrong_model_raises_naming_the_difference_and_leaves_the_model(tmp_path):
    wide = tiny(COCO, seed=7, hidden_dim=64)
    path = save_upstream(tmp_path / "wide.pth", wide.state_dict())
    model = tiny(COCO, seed=8)
    before = model.state_dict()["backbone.0.body.conv1.weight"].clone()
    with pytest.raises(ValueError, match=r"another architecture .*hidden_dim 64 vs 32"):
        load_upstream(model, path, log=lambda s: None)
    assert torch.equal(model.state_dict()["backbone.0.body.conv1.weight"], before)


def test_wrong_backbone_named(coco_sd, tmp_path):
    with torch.device("meta"):
        r50 = build_dino(DinoConfig(), COCO)
    sd = {k: torch.zeros(v.shape) for k, v in r50.state_dict().items() if k.startswith("backbone.")}
    sd.update({k: v for k, v in coco_sd.items() if not k.startswith("backbone.")})
    # a resnet50 backbone under a tiny transformer: most tensors still fit, the backbone is skipped and named
    lines = []
    report = load_upstream(tiny(COCO, seed=9), save_upstream(tmp_path / "r50.pth", sd), log=lines.append)
    assert report.skipped and report.unexpected
    assert any("backbone resnet50 vs resnet18" in line for line in lines)


class NotAllowed:  # pickled beside the weights: not loadable with weights_only=True
    def __init__(self):
        self.lr = 1e-4


@pytest.mark.parametrize(
    "content, match",
    [
        (None, r"is not a file"),
        ([1, 2, 3], r"is not a state_dict \(got list"),
        ({"model": {"a": 1}}, r"\['model'\] is not a state_dict: 'a' holds a int"),
        ({}, r"is not a state_dict \(got an empty dict"),
        (b"garbage", r"could not be read by torch.load"),
    ],
)
def test_unusable_files_raise_one_line(content, match, tmp_path):
    path = tmp_path / "x.pth"
    if isinstance(content, bytes):
        path.write_bytes(content * 10)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(ValueError, match=match) as e:
        load_upstream(tiny(2, seed=0), path, log=lambda s: None)
    assert "\n" not in str(e.value)


def test_other_pickled_objects_load_only_after_saying_so(coco_sd, tmp_path):
    path = save_upstream(tmp_path / "pickled.pth", coco_sd, args=NotAllowed())
    lines = []
    report = load_upstream(tiny(COCO, seed=10), path, log=lines.append)
    assert "weights_only=False" in lines[0] and "NotAllowed" in lines[0]
    assert len(report.loaded) == len(coco_sd)


# .. through the detection task ...........................................................................
def _task(tmp_path, rank=0, **kw):
    over = {k: v for k, v in TINY.items() if k != "backbone"}
    cfg = load_config(
        None, {"task": "detection", "model": "resnet18", "device": "cpu", "data_dir": str(tmp_path), **over, **kw}
    )
    return build_task(cfg, DistInfo(rank, rank, 2, torch.device("cpu")))


def test_task_builds_the_model_with_the_checkpoints_weights(coco_sd, coco_ckpt, tmp_path, capsys):
    task = _task(tmp_path, init_from=coco_ckpt)
    task.check_config()
    model = task.build_model(2)
    assert torch.equal(model.transformer.level_embed, coco_sd["transformer.level_embed"])
    assert model.class_embed[0].weight.shape == (2, 32)
    out = capsys.readouterr().out
    assert "init_from: loaded" in out and "(class heads, label_enc: 2 classes vs 91)" in out
    assert task.init_report.summary() in out
    _task(tmp_path, rank=1, init_from=coco_ckpt).build_model(2)  # other ranks load quietly
    assert capsys.readouterr().out == ""


def test_task_refuses_a_missing_or_unusable_init_from(tmp_path):
    with pytest.raises(ConfigError, match=r"init_from: /nonexistent/ck.pth is not a file"):
        _task(tmp_path, init_from="/nonexistent/ck.pth").check_config()
    junk = tmp_path / "junk.pth"
    torch.save([1, 2], junk)
    task = _task(tmp_path, init_from=str(junk))
    task.check_config()
    with pytest.raises(ConfigError, match=r"^init_from: .*junk.pth is not a state_dict"):
        task.build_model(2)


def test_init_from_takes_our_checkpoint_folder_and_checkpoint_dir(coco_sd, tmp_path):
    """A ckpt-* folder (what --resume and predict take) and a checkpoint_dir with ``latest`` load as the file
    does: our state.pt holds the weights under ``model``, beside the config, progress and optimizer."""
    ck = tmp_path / "checkpoints" / "ckpt-000000012"
    ck.mkdir(parents=True)
    torch.save({"model": coco_sd, "config": {"task": "detection"}, "progress": {"global_step": 12}}, ck / "state.pt")
    (ck.parent / "latest").write_text("ckpt-000000012\n")
    for path in (ck, ck.parent):
        model = tiny(COCO, seed=6)
        report = load_upstream(model, path, log=lambda s: None)
        assert len(report.loaded) == len(coco_sd) and not report.missing, path
        assert torch.equal(model.state_dict()["transformer.level_embed"], coco_sd["transformer.level_embed"])
        _task(tmp_path, init_from=str(path)).check_config()
    with pytest.raises(ConfigError, match=r"init_from: .*empty is not a file or a checkpoint folder"):
        (tmp_path / "empty").mkdir()
        _task(tmp_path, init_from=str(tmp_path / "empty")).check_config()
