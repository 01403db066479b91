"""Shape checks of a model before any data is read: build it on the meta device and run one input of each shape
(shapes only: no memory, no weights). The one mechanism behind classification's image-size check and video's
clip-size check."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Optional

import torch
from torch import nn

from trainer.errors import ConfigError, error_detail, shorten


def meta_rejection(build: Callable[[], nn.Module], shapes: Iterable[tuple[int, ...]]) -> Optional[tuple[tuple, str]]:
    """``(shape, the model's message)`` of the first input shape the model rejects, or None when it takes them all
    or cannot be checked (it reads tensor values while building, e.g. the RegNets, or meets an op without a meta
    kernel). ``build`` runs under ``torch.device("meta")``; the model runs in eval mode under ``no_grad``.

    Raises:
        ConfigError: from ``build`` (an unknown model name), unchanged.
    """
    with warnings.catch_warnings():  # some torchvision models warn about their init; the real build warns once
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                model = build().eval()
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - not buildable on meta: nothing to check here
            return None
        for shape in shapes:
            try:
                with torch.no_grad():
                    model(torch.empty(*shape, device="meta"))
            except NotImplementedError:  # an op without a meta kernel: cannot tell
                return None
            except (AssertionError, RuntimeError, ValueError, IndexError) as e:
                return tuple(shape), (shorten(str(e).splitlines()[0], 300) if str(e) else error_detail(e))
    return None
