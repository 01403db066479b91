"""The stand-in of the Deep Learning Container base (images/standin): it sets the environment, labels, EXPOSE,
WORKDIR, ENTRYPOINT and scripts the DLC's recipe gives its SageMaker image (dlc-recipe.json, written by dlc_recipe.py
from the DLC's Dockerfile.cuda and 2.13-sagemaker-cuda.yml) and nothing else (no pip setting, so that what builds
FROM it builds FROM the DLC), at the config's versions; and dlc_pins.py takes, of a name the DLC's uv.lock holds
twice, the entry whose resolution markers match the DLC's platform."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
from conftest import REPO

from infra.cli import image

STANDIN = REPO / "images" / "standin"
#: What the DLC's recipe gives its SageMaker image (images/standin/dlc_recipe.py, from the fetched Dockerfile.cuda
#: and 2.13-sagemaker-cuda.yml; its "source" names the DLC commit)
RECIPE = json.loads((STANDIN / "dlc-recipe.json").read_text())
#: What the DLC's base (nvidia/cuda:13.3.0-runtime-amzn2023, RECIPE["base"]) sets and the DLC's ENV extends or
#: keeps: nvidia/cuda's base Dockerfiles (gitlab.com/nvidia/container-images/cuda, dist/<version>/<os>/base; not
#: fetchable here, read through copies of them) put /usr/local/nvidia/bin:/usr/local/cuda/bin before the OS's PATH,
#: set LD_LIBRARY_PATH, CUDA_VERSION and the NVIDIA Container Toolkit's defaults (NVIDIA Container Toolkit docs,
#: "Specialized Configurations with Docker", "Environment variables (OCI spec)": "These variables are already set in
#: the NVIDIA-provided base CUDA images"). NVIDIA_REQUIRE_CUDA and the NV_* package versions are left out: their
#: 13.3 values cannot be read here (docs/training-image.md).
CUDA_BASE_ENV = {
    "PATH": "/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
    "CUDA_VERSION": RECIPE["config"]["cuda_version"],
    "NVIDIA_VISIBLE_DEVICES": "all",
    "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
}
#: DLC files the stand-in leaves out (telemetry: a request to AWS at every start) and installers run from /tmp
LEFT_OUT = {"deep_learning_container.py"}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, STANDIN / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _standin() -> dict:
    return _load("dlc_recipe").recipe((STANDIN / "Containerfile").read_text(), {"build": {}}, "", ("dlc/",))


def dlc_env() -> dict:
    """The DLC's ENV as the image has it: ``${PATH}`` and ``${LD_LIBRARY_PATH}`` from its nvidia/cuda base, and the
    venv's python3.13 where the DLC's is 3.12 (the stand-in's one difference there: docs/training-image.md)."""
    py = "python" + RECIPE["config"]["python_version"]
    env = {**CUDA_BASE_ENV}
    for key, value in RECIPE["env"].items():
        value = re.sub(r"\$\{(PATH|LD_LIBRARY_PATH)\}", lambda m: CUDA_BASE_ENV[m[1]], value)
        env[key] = value.replace(f"/lib/{py}/", "/lib/python3.13/")
    return env


def test_the_standin_sets_only_what_the_dlc_sets():
    """PIP_CERT in the stand-in made --ca-bundle work there only: the DLC has no such setting."""
    _, _, env = image.parse_dockerfile(STANDIN / "Containerfile")
    assert set(env) <= set(dlc_env()), set(env) - set(dlc_env())
    assert not [k for k in env if k.startswith(("PIP_", "REQUESTS_", "SSL_CERT"))]


def test_the_standin_has_the_dlcs_environment_labels_and_entrypoint():
    """The stand-in's PATH and LD_LIBRARY_PATH ended where the DLC's go on with its nvidia/cuda base's
    (/usr/local/nvidia/...), and it had neither the DLC's labels (which an image built FROM it inherits), nor its
    EXPOSE 22, nor /usr/local/bin/entrypoint.sh."""
    ours = _standin()
    assert ours["env"] == dlc_env()
    assert ours["labels"] == RECIPE["labels"]
    assert (ours["expose"], ours["workdir"]) == (RECIPE["expose"], RECIPE["workdir"])
    assert (ours["entrypoint"], ours["cmd"]) == (RECIPE["entrypoint"], RECIPE["cmd"])
    kept = {n: d for n, d in RECIPE["copies"].items() if not d.startswith("/tmp/") and n not in LEFT_OUT}
    assert {n: ours["copies"].get(n) for n in kept} == kept


def test_the_standin_has_the_versions_of_the_dlcs_config():
    config = RECIPE["config"]
    assert (config["target"], config["python_version"]) == ("sagemaker", "3.12")
    pins = dict(line.split("==") for line in (STANDIN / "dlc-packages.txt").read_text().split() if "==" in line)
    for name in ("torch", "torchvision", "torchaudio", "deepspeed"):
        assert pins[name] == config[f"{name}_version"], name
    cuda = ".".join(config["cuda_version"].split(".")[:2])
    wheels = re.search(r'CUDA_WHEELS:-([^}"]+)', (STANDIN / "install_cuda_toolkit.sh").read_text())[1].split()
    assert all(w.split("==")[1].startswith(cuda + ".") for w in wheels), wheels
    assert f"/usr/local/cuda-{cuda}" in (STANDIN / "Containerfile").read_text()


def _dlc_pins():
    return _load("dlc_pins")


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
