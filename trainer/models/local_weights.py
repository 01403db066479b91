"""Weights from local files (offline: no hub), checked before loading: the one reader behind the config fields that
name a state_dict file (segmentation's ``encoder_weights``, video's ``frame_weights``, detection's
``pretrained_backbone``)."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from trainer.errors import ConfigError, error_detail


def read_state_dict(path: str | Path, field: str, unwrap: tuple[str, ...] = ()) -> Mapping[str, torch.Tensor]:
    """The tensors of a ``.pth``/``.pt`` (``torch.load(weights_only=True)``) or ``.safetensors`` file.

    ``unwrap``: keys of a wrapping dict to look inside (e.g. ``("model",)`` for ``{"model": state_dict, ...}``
    checkpoints); the first one present whose value is a dict is the state_dict.

    Raises:
        ConfigError: ``<field>: ...`` naming the file: no such file, unreadable, or not a dict of tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{field}: no file at {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ConfigError(
            f"{field}: cannot read {path} as a state_dict (not a torch.save file of tensors only); "
            "expected torch.save(model.state_dict(), path) or a .safetensors file"
        ) from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is a config error
        raise ConfigError(f"{field}: cannot read {path} as a state_dict ({error_detail(e, 160)})") from None
    if isinstance(state, Mapping):
        inner = [state[k] for k in unwrap if isinstance(state.get(k), Mapping)]
        state = inner[0] if inner else state
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{field}: {path} does not hold a dict of tensors (got {type(state).__name__})")
    return state


def state_dict_diff(own: Mapping[str, torch.Tensor], state: Mapping) -> tuple[list[str], list[str], list[str]]:
    """(keys of ``own`` missing in ``state``, keys of ``state`` not in ``own``, ``"key (file shape) vs (own
    shape)"`` for the tensors whose shapes differ), each in key order; values of ``state`` that are not tensors
    are not shape-checked."""
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape
    ]
    return missing, unexpected, shapes


def load_checked(module: nn.Module, state: Mapping[str, torch.Tensor], path: str | Path, field: str, what: str) -> None:
    """``module.load_state_dict(state, strict=True)`` after checking every key and shape.

    Raises:
        ConfigError: ``<field>: <path> does not match <what>: N missing keys (first: ...); N unexpected keys
            (first: ...); N shape mismatches, file vs model (first: ...)`` (the first three of each).
    """
    missing, unexpected, shapes = state_dict_diff(module.state_dict(), state)
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys (first: {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys (first: {', '.join(unexpected[:3])})")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatches, file vs model (first: {'; '.join(shapes[:3])})")
    if problems:
        raise ConfigError(f"{field}: {path} does not match {what}: {'; '.join(problems)}")
    module.load_state_dict(state, strict=True)
