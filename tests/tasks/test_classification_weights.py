"""Classification's ``weights``: a local state_dict or checkpoint file, or a torchvision weights name read from a
pre-filled torch.hub cache (no network), with the head replaced for the data's classes; bad input in one line."""

from __future__ import annotations

import urllib.error

import pytest
import torch
import torchvision
from conftest import tiny_overrides

from trainer.cli import main
from trainer.config import load_config
from trainer.engine.distributed import DistInfo
from trainer.errors import ConfigError
from trainer.tasks import build_task

CPU = DistInfo(0, 0, 1, torch.device("cpu"))


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory):
    """A seeded resnet18 with ImageNet's 1000-class head, saved as a plain state_dict."""
    torch.manual_seed(7)
    model = torchvision.models.resnet18(num_classes=1000)
    path = tmp_path_factory.mktemp("w") / "resnet18-imagenet-like.pth"
    torch.save(model.state_dict(), path)
    return path, model.state_dict()


def _model(tiny_digits, tmp_path, capsys, weights, **kw):
    task = build_task(load_config(None, tiny_overrides(tiny_digits, tmp_path, weights=str(weights), **kw)), CPU)
    model = task.build_model(2)
    return model, capsys.readouterr().out


def test_a_local_file_loads_every_tensor_but_the_head_it_replaces(tiny_digits, tmp_path, capsys, imagenet_like):
    path, state = imagenet_like
    model, out = _model(tiny_digits, tmp_path, capsys, path)
    assert f"weights: loaded {len(state) - 2} tensors from {path}; head fc re-initialised for 2 classes" in out
    assert "(the file's has 1000)" in out
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items() if not k.startswith("fc."))
    assert own["fc.weight"].shape == (2, 512)
    # a timm/torchvision training checkpoint: the weights under "state_dict", DDP's "module." prefix
    wrapped = tmp_path / "checkpoint.pth.tar"
    torch.save({"epoch": 90, "state_dict": {f"module.{k}": v for k, v in state.items()}}, wrapped)
    model, out = _model(tiny_digits, tmp_path, capsys, wrapped)
    assert torch.equal(model.state_dict()["conv1.weight"], state["conv1.weight"]) and "head fc re-initialised" in out


def test_a_torchvision_name_reads_torch_hubs_cache(tiny_digits, tmp_path, capsys, imagenet_like, monkeypatch):
    path, state = imagenet_like
    hub = tmp_path / "hub"
    (hub / "checkpoints").mkdir(parents=True)
    cached = hub / "checkpoints" / torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url.rsplit("/", 1)[1]
    cached.write_bytes(path.read_bytes())
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))

    def offline(*a, **k):
        raise urllib.error.URLError("no network in tests")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    for name in ("IMAGENET1K_V1", "DEFAULT", "ResNet18_Weights.IMAGENET1K_V1"):
        model, out = _model(tiny_digits, tmp_path, capsys, name)
        assert "from ResNet18_Weights.IMAGENET1K_V1" in out and "head fc re-initialised for 2 classes" in out
        assert torch.equal(model.state_dict()["layer4.1.conv2.weight"], state["layer4.1.conv2.weight"])
    cached.unlink()  # not cached, and the download fails: one line saying where the file belongs
    with pytest.raises(ConfigError, match=r"^weights: ResNet18_Weights.IMAGENET1K_V1 is not in torch.hub's cache"):
        _model(tiny_digits, tmp_path, capsys, "IMAGENET1K_V1")


@pytest.mark.parametrize(
    "weights, message",
    [
        (
            "IMAGENET1K_V9",
            r"^weights: 'IMAGENET1K_V9' is not a weights name of resnet18; torchvision has IMAGENET1K_V1",
        ),
        ("missing.pth", r"^weights: no file at .*missing\.pth$"),
        (
            "RESNET34",
            r"^weights: .*resnet34\.pth does not match torchvision resnet18: .*unexpected keys \(first: layer1\.2",
        ),
    ],
)
def test_bad_weights_are_one_line(tiny_digits, tmp_path, capsys, weights, message):
    if weights == "RESNET34":
        weights = tmp_path / "resnet34.pth"
        torch.save(torchvision.models.resnet34().state_dict(), weights)
    elif weights.endswith(".pth"):
        weights = tmp_path / weights
    with pytest.raises(ConfigError, match=message) as e:
        _model(tiny_digits, tmp_path, capsys, weights)
    assert "\n" not in str(e.value)


def test_train_starts_from_the_file_and_predict_does_not_need_it(tiny_digits, tmp_path, capsys, imagenet_like):
    """The run prints the report; its checkpoint carries the weights, so predict rebuilds without the file."""
    path, _ = imagenet_like
    over = tiny_overrides(tiny_digits, tmp_path, epochs=1, max_steps_per_epoch=2, weights=str(path))
    args = [f"--{k.replace('_', '-')}={v}" for k, v in over.items()]
    assert main(["train", *args]) == 0
    assert "head fc re-initialised for 10 classes (the file's has 1000)" in capsys.readouterr().out
    moved = path.with_suffix(".gone")
    path.rename(moved)
    try:
        out = tmp_path / "pred"
        assert (
            main(
                [
                    "predict",
                    "--checkpoint",
                    over["checkpoint_dir"],
                    "--images",
                    str(tiny_digits / "val" / "0"),
                    "--out",
                    str(out),
                    "--limit",
                    "2",
                ]
            )
            == 0
        )
    finally:
        moved.rename(path)
    assert (out / "predictions.json").is_file()
