"""Pretrained weights for a torchvision classifier (the classification task's ``weights`` field): a torchvision
weights name loaded through torchvision's own API and torch.hub's cache, or a local file; the classifier head is
replaced when the file's classes differ from the data's.

Fine-tuning from ImageNet weights is what torchvision's transfer-learning tutorial ("Transfer learning for
computer vision", the hymenoptera set) and timm's ``--pretrained`` do.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torchvision
from torch import nn

from trainer.errors import ConfigError, error_detail
from trainer.models.local_weights import load_checked, read_state_dict

#: Suffixes that make ``weights`` a file rather than a torchvision weights name.
FILE_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors", ".ckpt", ".tar")
#: Wrapping keys of checkpoints (timm's train.py: ``state_dict``, ``state_dict_ema``; torchvision's references:
#: ``model``, ``model_ema``), the plain weights first.
UNWRAP = ("state_dict", "model")


def is_weights_file(weights: str) -> bool:
    """True when ``weights`` names a file (a path separator or a weights-file suffix), False for a torchvision
    weights name such as ``IMAGENET1K_V2`` or ``DEFAULT``."""
    return "/" in weights or weights.endswith(FILE_SUFFIXES) or Path(weights).is_file()


def head_name(model: nn.Module, num_classes: int) -> str:
    """The dotted name of ``model``'s classifier head: its last ``nn.Linear`` with ``num_classes`` outputs
    (torchvision: ResNet ``fc``, ViT ``heads.head``, EfficientNet/MobileNet ``classifier.1``, ConvNeXt
    ``classifier.2``, Swin ``head``); "" when there is none (e.g. SqueezeNet's convolution head)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.out_features == num_classes]
    return names[-1] if names else ""


def load_pretrained(model: nn.Module, model_name: str, weights: str, num_classes: int) -> str:
    """Fill ``model`` (torchvision classifier ``model_name`` built for ``num_classes``) from ``weights``; returns
    the one-line report.

    ``weights``: a torchvision weights name of this model (``IMAGENET1K_V2``, ``DEFAULT``, or the full
    ``ResNet50_Weights.IMAGENET1K_V2``), read by ``WeightsEnum.get_state_dict`` from torch.hub's cache
    (``$TORCH_HOME/hub/checkpoints``; downloaded once when the machine is online); or a local ``.pth``/``.pt``/
    ``.safetensors`` file holding a state_dict, or a checkpoint wrapping one under ``state_dict`` (timm) or ``model``
    (torchvision's references), DDP's ``module.`` prefix removed. Every tensor must match by name and shape,
    except the head's (:func:`head_name`) when the file has another number of classes: it keeps its fresh
    initialisation, and the report says so.

    Raises:
        ConfigError: ``weights: ...`` in one line: an unknown weights name (the model's names listed), a name not in
            the hub cache that cannot be downloaded, an unreadable file, or keys that do not match (the first
            missing / unexpected / mismatched keys named).
    """
    if is_weights_file(weights):
        state = dict(read_state_dict(weights, "weights", unwrap=UNWRAP))
        if state and all(k.startswith("module.") for k in state):
            state = {k.removeprefix("module."): v for k, v in state.items()}
        source = str(weights)
    else:
        state, source = _torchvision_state(model_name, weights)
    own = model.state_dict()
    head = head_name(model, num_classes)
    head_keys = [k for k in own if head and k.startswith(head + ".")]
    replaced = [k for k in head_keys if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    file_classes = int(state[replaced[0]].shape[0]) if replaced else None
    if replaced:
        state = {**state, **{k: own[k] for k in head_keys}}  # the head keeps its fresh initialisation
    load_checked(model, state, weights, "weights", f"torchvision {model_name}")
    loaded = len(own) - (len(head_keys) if replaced else 0)
    line = f"weights: loaded {loaded} tensors from {source}"
    if replaced:
        line += f"; head {head} re-initialised for {num_classes} classes (the file's has {file_classes})"
    return line


def _torchvision_state(model_name: str, name: str) -> tuple[Mapping[str, torch.Tensor], str]:
    """The state_dict of torchvision weights ``name`` of ``model_name`` and its full name, from torch.hub's cache."""
    try:
        enum = torchvision.models.get_model_weights(model_name)
    except (ValueError, KeyError):
        raise ConfigError(f"weights: torchvision has no weights for model {model_name}; give a local file") from None
    member = name.split(".", 1)[1] if name.startswith(enum.__name__ + ".") else name
    if member not in enum.__members__:
        raise ConfigError(
            f"weights: {name!r} is not a weights name of {model_name}; torchvision has "
            f"{', '.join(enum.__members__)} ({enum.__name__}), or give a local .pth/.safetensors file"
        )
    w = enum[member]
    full = f"{enum.__name__}.{w.name}"
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(w.url).name
    try:
        return w.get_state_dict(progress=False, check_hash=True), f"{full} ({cached})"
    except Exception as e:  # noqa: BLE001 - offline, a damaged cache file: one line either way
        raise ConfigError(
            f"weights: {full} is not in torch.hub's cache ({cached}) and could not be read or downloaded "
            f"({error_detail(e, 120)}); copy the file there, or give a local file"
        ) from None
