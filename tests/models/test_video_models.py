"""Video models: the frozen-ResNet frame transformer (frozen, eval-mode BN, order-dependent, weights from a local
file), the torchvision video models on (B, T, 3, H, W) clips, the meta-device input check, FakeTensorMode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torchvision
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from trainer.errors import ConfigError
from trainer.models.video import (
    FRAME_BACKBONES,
    VIDEO_MODELS,
    FrameTransformer,
    TorchvisionVideoModel,
    build_video_model,
    check_video_input,
)

T, S = 8, 32


def _small(**kw) -> FrameTransformer:
    torch.manual_seed(0)
    return FrameTransformer(5, dim=32, depth=2, heads=4, mlp_dim=64, max_frames=T, **kw)


def _clip(b: int = 2, t: int = T, s: int = S) -> torch.Tensor:
    return torch.randn(b, t, 3, s, s, generator=torch.Generator().manual_seed(1))


def test_the_names():
    assert VIDEO_MODELS[0] == "frame_transformer"
    assert {"r3d_18", "mc3_18", "r2plus1d_18", "s3d", "mvit_v1_b", "swin3d_t"} <= set(VIDEO_MODELS)
    assert {"resnet18", "resnet34", "resnet50"} <= set(FRAME_BACKBONES)


def test_the_backbone_is_frozen_and_stays_in_eval_mode():
    model = _small().train()
    assert model.training and model.layers[0].training
    assert not any(p.requires_grad for p in model.backbone.parameters())
    assert not any(m.training for m in model.backbone.modules())
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("backbone."))
    assert model.feature_dim == 512


def test_a_training_step_leaves_the_backbone_alone():
    model = _small().train()
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    model(_clip()).logsumexp(1).sum().backward()
    after = model.backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN running stats included
    assert all(p.grad is None for p in model.backbone.parameters())
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("backbone."))
    model.backbone.train()  # the check bites: a backbone in training mode would update its statistics
    model(_clip())
    assert not torch.equal(before["bn1.running_mean"], model.backbone.bn1.running_mean)


def test_the_logits_depend_on_frame_order():
    model = _small().eval()
    clip = _clip()
    with torch.no_grad():
        y = model(clip)
        reversed_ = model(clip.flip(1))
        permuted = model(clip[:, torch.randperm(T, generator=torch.Generator().manual_seed(2))])
    assert y.shape == (2, 5) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert not torch.allclose(y, reversed_, atol=1e-4)
    assert not torch.allclose(y, permuted, atol=1e-4)


def test_forward_is_forward_features_of_frame_features():
    model = _small().eval()
    clip = _clip()
    with torch.no_grad():
        features = model.frame_features(clip.flatten(0, 1))
        assert features.shape == (2 * T, 512) and features.dtype == torch.float32
        direct = model(clip)
        via = model.forward_features(features.unflatten(0, (2, T)))
        half = model.forward_features(features.unflatten(0, (2, T)).half())  # a cache may store fp16
    torch.testing.assert_close(direct, via, rtol=1e-4, atol=1e-5)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, direct, rtol=0.05, atol=0.05)
    with torch.no_grad():
        assert model(_clip(t=3)).shape == (2, 5)  # fewer frames than max_frames is fine


def test_more_frames_than_max_frames_is_a_value_error():
    model = _small().eval()
    with pytest.raises(ValueError, match=r"T=9.*max_frames=8"):
        model(_clip(t=T + 1))
    with pytest.raises(ValueError, match=r"T=9.*max_frames=8"):
        model.forward_features(torch.zeros(1, T + 1, 512))


@pytest.mark.parametrize("keep_fc", [True, False])
def test_frame_weights_round_trip(tmp_path, keep_fc):
    torch.manual_seed(3)
    reference = torchvision.models.resnet18().eval()
    state = reference.state_dict()
    if not keep_fc:
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    torch.save(state, tmp_path / "r18.pt")
    model = _small(frame_weights=str(tmp_path / "r18.pt"))
    reference.fc = torch.nn.Identity()
    frames = _clip().flatten(0, 1)
    with torch.no_grad():
        torch.testing.assert_close(model.frame_features(frames), reference(frames))


def test_bad_frame_weights_are_config_errors(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    torch.save([1, 2], tmp_path / "list.pt")
    r18 = torchvision.models.resnet18().state_dict()
    torch.save({k: v for k, v in r18.items() if k != "conv1.weight"}, tmp_path / "missing.pt")
    torch.save({**r18, "extra.weight": torch.zeros(1)}, tmp_path / "extra.pt")
    torch.save({**r18, "conv1.weight": torch.zeros(64, 3, 3, 3)}, tmp_path / "shape.pt")
    cases = {
        "nowhere.pt": "no file",
        "garbage.pt": "cannot read",
        "list.pt": "dict of tensors",
        "missing.pt": "1 missing keys.*conv1.weight",
        "extra.pt": "1 unexpected keys.*extra.weight",
        "shape.pt": r"1 shape mismatches.*conv1.weight \(64, 3, 3, 3\) vs \(64, 3, 7, 7\)",
    }
    for name, expected in cases.items():
        cfg = SimpleNamespace(model="frame_transformer", frame_weights=str(tmp_path / name), num_frames=T)
        with pytest.raises(ConfigError, match=rf"^frame_weights: (?=.*{name}).*{expected}"):
            build_video_model(cfg, 5)


@pytest.mark.parametrize("name", ["r3d_18", "mc3_18", "r2plus1d_18"])
def test_torchvision_video_models_take_b_t_c_h_w_clips(name):
    torch.manual_seed(0)
    model = build_video_model(SimpleNamespace(model=name), 4).eval()
    assert isinstance(model, TorchvisionVideoModel)
    with torch.no_grad():
        y = model(_clip(b=1, t=4, s=S))
    assert y.shape == (1, 4) and torch.isfinite(y).all()


@pytest.mark.parametrize(
    "name, frames, size, ok",
    [
        ("frame_transformer", T, S, True),
        ("r3d_18", T, S, True),
        ("r2plus1d_18", T, S, True),
        ("swin3d_t", T, S, True),
        ("s3d", 16, 224, True),
        ("s3d", 8, 32, False),
        ("mvit_v1_b", 16, 224, True),
        ("mvit_v1_b", 32, 64, False),
    ],
)
def test_check_video_input_on_meta(name, frames, size, ok):
    cfg = SimpleNamespace(model=name, num_frames=frames, image_size=size)
    if ok:
        check_video_input(cfg)
    else:
        with pytest.raises(ConfigError, match=rf"^model: {name} .*num_frames={frames}.*image_size={size}"):
            check_video_input(cfg)


def test_bad_names_and_sizes_are_config_errors():
    with pytest.raises(ConfigError, match=r"^model: unknown video model 'r3d18'; did you mean r3d_18"):
        build_video_model(SimpleNamespace(model="r3d18"), 5)
    with pytest.raises(ConfigError, match=r"^model: unknown"):
        check_video_input(SimpleNamespace(model="frame_transformr", num_frames=T, image_size=S))
    with pytest.raises(ConfigError, match=r"^frame_backbone: unknown frame backbone 'resnet19'.*resnet18"):
        build_video_model(SimpleNamespace(model="frame_transformer", frame_backbone="resnet19"), 5)
    with pytest.raises(ConfigError, match=r"^temporal_heads: 6 must divide temporal_dim=256"):
        build_video_model(SimpleNamespace(model="frame_transformer", temporal_heads=6), 5)


def test_the_frame_backbone_sets_feature_dim():
    with torch.device("meta"):
        for backbone, dim in [("resnet18", 512), ("resnet34", 512), ("resnet50", 2048)]:
            cfg = SimpleNamespace(model="frame_transformer", frame_backbone=backbone)
            assert build_video_model(cfg, 5).feature_dim == dim


def test_the_default_parameter_counts():
    with torch.device("meta"):
        model = build_video_model(SimpleNamespace(model="frame_transformer"), 10)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen == 11_176_512  # resnet18 without fc: 11,689,512 - 513,000
    assert trainable == 3_302_154  # dim 256, 4 layers, mlp 1024, 33 positions, 10 classes


@pytest.mark.parametrize("name", ["frame_transformer", "r3d_18", "swin3d_t"])
def test_build_and_run_under_fake_tensor_mode(name):
    cfg = SimpleNamespace(model=name, num_frames=32, temporal_layers=2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_video_model(cfg, 5).train()
        assert all(isinstance(p, FakeTensor) and p.device.type == "cpu" for p in model.parameters())
        y = model(torch.empty(2, 32, 3, 64, 64))
        assert isinstance(y, FakeTensor) and y.shape == (2, 5)
        y.sum().backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None for p in trainable)
