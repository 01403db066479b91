"""The stand-in of the Deep Learning Container base (images/standin): it sets only the environment the DLC's recipe
sets (no pip setting, so that what builds FROM it builds FROM the DLC), and dlc_pins.py takes, of a name the DLC's
uv.lock holds twice, the entry whose resolution markers match the DLC's platform."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import REPO

from infra.cli import image

# The ENV keys of aws/deep-learning-containers docker/pytorch/Dockerfile.cuda's sagemaker target (runtime-base:
# PYTHONDONTWRITEBYTECODE ... CUDA_HOME; sagemaker: SAGEMAKER_TRAINING_MODULE, UV_PROJECT_ENVIRONMENT, PATH,
# LD_LIBRARY_PATH). No PIP_CERT, no PIP_DISABLE_PIP_VERSION_CHECK.
DLC_ENV = {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "LANG", "LC_ALL", "DLC_CONTAINER_TYPE"}
DLC_ENV |= {"CUDA_HOME", "SAGEMAKER_TRAINING_MODULE", "UV_PROJECT_ENVIRONMENT", "PATH", "LD_LIBRARY_PATH"}


def test_the_standin_sets_only_what_the_dlc_sets():
    """PIP_CERT in the stand-in made --ca-bundle work there only: the DLC has no such setting."""
    _, _, env = image.parse_dockerfile(REPO / "images" / "standin" / "Containerfile")
    assert set(env) <= DLC_ENV, set(env) - DLC_ENV
    assert not [k for k in env if k.startswith(("PIP_", "REQUESTS_", "SSL_CERT"))]


def _dlc_pins():
    spec = importlib.util.spec_from_file_location("dlc_pins", REPO / "images" / "standin" / "dlc_pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LINUX = "platform_machine != 'x86_64' or sys_platform != 'darwin'"
MAC_X86 = "platform_machine == 'x86_64' and sys_platform == 'darwin'"


def _lock(entries: list[dict]) -> dict:
    root = {"name": "pytorch-dlc", "version": "0", "optional-dependencies": {"sagemaker": []}}
    root["dependencies"] = [{"name": "shap", "marker": LINUX}, {"name": "numpy"}]
    return {"package": [root, {"name": "numpy", "version": "2.4.3"}, *entries]}


def test_a_name_locked_twice_gives_the_entry_whose_markers_match_linux_not_the_last():
    """uv.lock has shap 0.51.0 (everywhere but macOS x86_64) and 0.50.0 (macOS x86_64); with the macOS entry
    last, the last-entry rule pinned 0.50.0."""
    linux = {"name": "shap", "version": "0.51.0", "resolution-markers": [LINUX]}
    mac = {"name": "shap", "version": "0.50.0", "resolution-markers": [MAC_X86]}
    pins = _dlc_pins()
    for entries in ([linux, mac], [mac, linux]):
        chosen = pins.closure(_lock(entries))
        assert {n: p["version"] for n, p in chosen.items()} == {"numpy": "2.4.3", "shap": "0.51.0"}


def test_a_dependency_that_names_its_version_gets_that_entry():
    pins = _dlc_pins()
    lock = _lock([{"name": "shap", "version": "0.51.0"}, {"name": "shap", "version": "0.50.0"}])
    lock["package"][0]["dependencies"][0]["version"] = "0.51.0"
    assert pins.closure(lock)["shap"]["version"] == "0.51.0"
    del lock["package"][0]["dependencies"][0]["version"]  # two entries, neither with markers: ambiguous
    with pytest.raises(ValueError, match=r"shap: 2 lock entries fit"):
        pins.closure(lock)
