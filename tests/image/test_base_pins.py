"""images/training/base_pins.py, the Dockerfile's first step: the base's torch family held as installed, and the
base's full mlflow moved to the trainer's mlflow-skinny pin (mlflow pins its halves exactly, so `pip check` fails
the build when only the skinny half moves: the DLC ships mlflow 3.15.1)."""

from __future__ import annotations

import importlib.util
import os

from conftest import REPO


def load():
    spec = importlib.util.spec_from_file_location("base_pins", REPO / "images" / "training" / "base_pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_base_with_mlflow_moves_it_with_the_skinny_pin(tmp_path, monkeypatch):
    pins = load()
    base = {"torch": "2.13.0+cu130", "torchvision": "0.28.0+cu130", "triton": "3.7.1", "mlflow": "3.15.1"}
    monkeypatch.setattr(pins, "installed", base.get)
    (tmp_path / "req.txt").write_text("numpy>=1.26\nmlflow-skinny==3.17.2  # the client\nwandb==0.31.0\n")
    monkeypatch.chdir(tmp_path)
    assert pins.main("req.txt") == 0
    assert (tmp_path / "constraints.txt").read_text().split() == [
        "torch==2.13.0+cu130",
        "torchvision==0.28.0+cu130",
        "triton==3.7.1",
    ]
    assert (tmp_path / "base-upgrades.txt").read_text().split() == ["mlflow==3.17.2"]


def test_a_base_without_mlflow_or_triton_gets_no_move(tmp_path, monkeypatch):
    pins = load()
    monkeypatch.setattr(pins, "installed", {"torch": "2.13.0", "torchvision": "0.28.0"}.get)
    (tmp_path / "req.txt").write_text((REPO / "requirements-trainer.txt").read_text())
    monkeypatch.chdir(tmp_path)
    assert pins.main("req.txt") == 0
    assert (tmp_path / "constraints.txt").read_text().split() == ["torch==2.13.0", "torchvision==0.28.0"]
    assert (tmp_path / "base-upgrades.txt").read_text() == ""
    assert os.path.getsize(tmp_path / "base-upgrades.txt") == 0


def test_the_trainer_pins_mlflow_skinny_so_the_move_applies():
    text = (REPO / "requirements-trainer.txt").read_text()
    assert "\nmlflow-skinny==" in text, "base_pins.MOVES_WITH assumes requirements-trainer.txt pins mlflow-skinny"
