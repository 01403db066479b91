"""Segmentation model builder: every architecture maps images to logits at the input size, encoder weights load
strictly from a local file, and bad configs raise ConfigError with one clear line."""

from __future__ import annotations

import re

import pytest
import torch

from trainer.errors import ConfigError
from trainer.models.segmentation import (
    SEGMENTATION_MODELS,
    SMP_ARCHS,
    TORCHVISION_ARCHS,
    build_segmentation_model,
    required_divisor,
)


def _encoder_name(arch: str) -> str:
    return "mit_b0" if arch == "segformer" else "resnet18"


def test_the_supported_names():
    assert set(SEGMENTATION_MODELS) == {
        "unet",
        "unetplusplus",
        "deeplabv3plus",
        "fpn",
        "segformer",
        "deeplabv3_resnet50",
        "deeplabv3_mobilenet_v3_large",
        "fcn_resnet50",
        "lraspp_mobilenet_v3_large",
    }


@pytest.mark.parametrize("arch", SEGMENTATION_MODELS)
def test_every_model_maps_images_to_logits_at_the_input_size(arch):
    torch.manual_seed(0)
    model = build_segmentation_model(arch, num_classes=3, encoder=_encoder_name(arch)).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        y = model(x)
    assert isinstance(y, torch.Tensor)
    assert y.shape == (1, 3, 64, 64)
    assert y.dtype == torch.float32
    assert torch.isfinite(y).all()
    if arch in TORCHVISION_ARCHS:
        with torch.no_grad():
            features = model.encoder(x)  # {"out"} or, for LRASPP, {"low" (1/8), "high" (1/16)}
        # the backbone's deepest features are 1/divisor of the input: 64 / 8 = 8, 64 / 16 = 4
        deepest = min(f.shape[-1] for f in features.values())
        assert deepest == 64 // required_divisor(arch)


def test_required_divisor():
    assert {a: required_divisor(a) for a in SMP_ARCHS} == dict.fromkeys(SMP_ARCHS, 32)
    assert required_divisor("deeplabv3_resnet50") == 8
    assert required_divisor("fcn_resnet50") == 8
    assert required_divisor("deeplabv3_mobilenet_v3_large") == 16
    assert required_divisor("lraspp_mobilenet_v3_large") == 16
    with pytest.raises(ConfigError, match="arch: unknown segmentation model 'unet3d'"):
        required_divisor("unet3d")


def _assert_same_encoder(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.encoder.state_dict(), b.encoder.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("arch", ["unet", "lraspp_mobilenet_v3_large"])
def test_encoder_weights_round_trip(tmp_path, arch):
    torch.manual_seed(0)
    source = build_segmentation_model(arch, 3, encoder="resnet18")
    path = tmp_path / "encoder.pt"
    torch.save(source.encoder.state_dict(), path)
    torch.manual_seed(1)
    fresh = build_segmentation_model(arch, 3, encoder="resnet18")
    first = next(iter(source.encoder.state_dict()))
    assert not torch.equal(fresh.encoder.state_dict()[first], source.encoder.state_dict()[first])
    loaded = build_segmentation_model(arch, 3, encoder="resnet18", encoder_weights=str(path))
    _assert_same_encoder(source, loaded)


def test_encoder_weights_accept_a_plain_torchvision_resnet(tmp_path):
    """The file that frame_weights and pretrained_backbone take (torchvision ResNet-18 with its fc.* head) loads
    into smp's ResNet-18 encoder, which has no fc; a file of another network is still refused."""
    import torchvision

    torch.manual_seed(3)
    resnet = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(resnet.state_dict(), path)
    model = build_segmentation_model("unet", 3, encoder="resnet18", encoder_weights=str(path))
    theirs = {k: v for k, v in resnet.state_dict().items() if not k.startswith("fc.")}
    assert model.encoder.state_dict().keys() == theirs.keys()
    assert all(torch.equal(model.encoder.state_dict()[k], v) for k, v in theirs.items())
    torch.save(torchvision.models.resnet34(weights=None).state_dict(), tmp_path / "r34.pth")
    with pytest.raises(ConfigError, match="encoder_weights: .*r34.pth does not match the unet/resnet18 encoder"):
        build_segmentation_model("unet", 3, encoder="resnet18", encoder_weights=str(tmp_path / "r34.pth"))


def test_encoder_weights_from_safetensors(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = build_segmentation_model("fpn", 2, encoder="resnet18")
    path = tmp_path / "encoder.safetensors"
    save_file({k: v.contiguous() for k, v in source.encoder.state_dict().items()}, str(path))
    torch.manual_seed(1)
    _assert_same_encoder(source, build_segmentation_model("fpn", 2, encoder="resnet18", encoder_weights=str(path)))


def test_unknown_arch_lists_the_known_names():
    with pytest.raises(ConfigError, match=r"arch: unknown segmentation model 'pspnet'; known: unet, unetplusplus, "):
        build_segmentation_model("pspnet", 3)


@pytest.mark.parametrize("encoder", ["resnet_nope", "tu-no_such_timm_model"])
def test_unknown_encoder(encoder):
    with pytest.raises(ConfigError, match=rf"encoder: smp .* cannot build 'unet' with encoder '{encoder}'") as e:
        build_segmentation_model("unet", 3, encoder=encoder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n", [0, -1])
def test_num_classes_below_one(n):
    with pytest.raises(ConfigError, match=rf"num_classes: must be an integer >= 1, got {n}"):
        build_segmentation_model("unet", n, encoder="resnet18")


def test_missing_encoder_weights_file(tmp_path):
    path = tmp_path / "nowhere.pt"
    with pytest.raises(ConfigError, match=rf"encoder_weights: no file at {re.escape(str(path))}"):
        build_segmentation_model("unet", 3, encoder="resnet18", encoder_weights=str(path))


def test_unreadable_encoder_weights_file(tmp_path):
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ConfigError, match=rf"encoder_weights: cannot read {re.escape(str(path))} as a state_dict"):
        build_segmentation_model("unet", 3, encoder="resnet18", encoder_weights=str(path))


def test_encoder_weights_with_wrong_keys(tmp_path):
    state = build_segmentation_model("unet", 3, encoder="resnet18").encoder.state_dict()
    del state["conv1.weight"]
    state["head.weight"] = torch.zeros(2)
    path = tmp_path / "wrong.pt"
    torch.save(state, path)
    with pytest.raises(
        ConfigError,
        match=r"encoder_weights: .*wrong\.pt does not match the unet/resnet18 encoder: 1 missing keys \(first: "
        r"conv1\.weight\); 1 unexpected keys \(first: head\.weight\)",
    ):
        build_segmentation_model("unet", 3, encoder="resnet18", encoder_weights=str(path))


def test_encoder_weights_of_another_encoder(tmp_path):
    # resnet18's blocks are a subset of resnet34's (layers of 2, 2, 2, 2 vs 3, 4, 6, 3 blocks)
    path = tmp_path / "r18.pt"
    torch.save(build_segmentation_model("unet", 3, encoder="resnet18").encoder.state_dict(), path)
    with pytest.raises(
        ConfigError, match=r"does not match the unet/resnet34 encoder: \d+ missing keys \(first: layer1\.2\."
    ):
        build_segmentation_model("unet", 3, encoder="resnet34", encoder_weights=str(path))


def test_encoder_weights_with_a_wrong_shape(tmp_path):
    state = build_segmentation_model("unet", 3, encoder="resnet18").encoder.state_dict()
    state["conv1.weight"] = torch.zeros(64, 4, 7, 7)
    path = tmp_path / "shape.pt"
    torch.save(state, path)
    with pytest.raises(
        ConfigError, match=r"1 shape mismatches, file vs model \(first: conv1\.weight \(64, 4, 7, 7\) vs "
    ):
        build_segmentation_model("unet", 3, encoder="resnet18", encoder_weights=str(path))


def test_encoder_weights_not_a_state_dict(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], path)
    with pytest.raises(ConfigError, match=r"encoder_weights: .*list\.pt does not hold a dict of tensors \(got list\)"):
        build_segmentation_model("unet", 3, encoder="resnet18", encoder_weights=str(path))


def test_sliding_window_equals_the_whole_image_when_it_fits_and_stitches_exactly():
    from trainer.models.segmentation import sliding_window_logits

    torch.manual_seed(0)
    unet = build_segmentation_model("unet", 3, encoder="resnet18").eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        assert torch.equal(sliding_window_logits(unet, x, 96, 1 / 3), unet(x))  # fits: one forward, same result
        # A pointwise model sees no context, so tiles stitched with averaged overlaps equal the whole image.
        pointwise = torch.nn.Conv2d(3, 4, 1)
        big = torch.randn(1, 3, 96, 160)
        tiled = sliding_window_logits(pointwise, big, 64, 1 / 3)
        torch.testing.assert_close(tiled, pointwise(big), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="overlap 1.0 in"):
        sliding_window_logits(pointwise, big, 64, 1.0)
