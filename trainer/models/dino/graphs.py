"""DINO's dense part captured as CUDA graphs, one per input shape (``cuda_graphs: true``).

Once fixed canvases (``canvases``) and a static-size denoising part (``dn_max_boxes``) fix every tensor shape of the
training step per canvas, the forward and backward of :meth:`~trainer.models.dino.model.DINO.dense` (backbone,
encoder, query selection, decoder, heads: ~3,400 kernel launches per step on an H200) can be replayed from a CUDA
graph instead of being launched one by one from Python. The pieces that read the host stay eager around it, as in
RF-DETR's training loop: contrastive denoising's layout (:meth:`~trainer.models.dino.model.DINO.denoising_queries`),
the matcher and the loss, clipping and the optimizer step.

Capture uses :func:`torch.cuda.make_graphed_callables` (PyTorch docs, "CUDA Graphs": "Partial-network capture"):
three warm-up iterations on a side stream, then one forward and one backward graph per shape. Each graph has its
own private memory pool, so memory grows with the number of shapes (at most ``max_graphs``; past it the dense part
runs eagerly, with a one-time notice). Pools are not shared: replaying graphs in another order than they were
captured in is only safe with separate pools (PyTorch docs, "Sharing memory across captures").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["GraphedDense"]


class _Dense(nn.Module):
    """``model.dense`` as a module of its own (the model a registered child, so its parameters are the graph's)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Tensor) -> tuple[Tensor, ...]:
        return self.model.dense(*args)


class GraphedDense:
    """Runs ``model.dense(images, mask, label, bbox, attn_mask)`` from a CUDA graph captured for each distinct
    input signature (shapes, dtypes, ``requires_grad``, autocast dtype), capturing on first sight.

    Args:
        model: the :class:`~trainer.models.dino.model.DINO` on a CUDA device, in training mode.
        max_graphs: at most this many captured signatures (canvases x the last, smaller batch of an epoch);
            later new signatures run eagerly.
        log: one-line notices (capture, the limit reached).

    Calls take the same arguments as ``model.dense`` (None for the denoising inputs when there are none) and
    return its five tensors. Those are the graph's static outputs: overwritten by the next call of the same
    signature, so the step must consume them (loss, backward) before the next step, as the trainer does.
    Gradient accumulation is refused by the config (``accumulate_grad_batches`` 1): a second backward replay
    would overwrite the static gradient buffers the first one's ``.grad`` may still alias.
    """

    def __init__(self, model: nn.Module, max_graphs: int = 8, log: Callable[[str], None] | None = None) -> None:
        self.model = model
        self.max_graphs = max_graphs
        self.log = log or (lambda line: None)
        self.graphs: dict[tuple, Callable[..., tuple[Tensor, ...]]] = {}
        self._full_noted = False

    @staticmethod
    def signature(args: tuple[Tensor, ...]) -> tuple:
        """What a captured graph is valid for: each argument's shape, dtype and ``requires_grad``, and the
        autocast dtype (or None) in force."""
        cast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        return tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args) + (cast,)

    def __call__(self, images: Tensor, mask: Tensor, *dn: Tensor | None) -> tuple[Tensor, ...]:
        args = (images, mask, *(a for a in dn if a is not None))
        key = self.signature(args)
        graphed = self.graphs.get(key)
        if graphed is None:
            if len(self.graphs) >= self.max_graphs:
                if not self._full_noted:
                    self.log(f"cuda_graphs: {self.max_graphs} shapes captured; new shapes run eagerly")
                    self._full_noted = True
                return self.model.dense(*args)
            graphed = self.capture(args)
            self.graphs[key] = graphed
        return graphed(*args)

    def capture(self, args: tuple[Tensor, ...]) -> Callable[..., tuple[Tensor, ...]]:
        """Capture forward and backward for ``args``' signature (copies of ``args`` as the sample inputs).

        Raises:
            RuntimeError: CUDA refused the capture (e.g. an operation that reads the host inside the dense part).
        """
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        enabled = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda")
        shape = "x".join(str(d) for d in args[0].shape)
        self.log(f"cuda_graphs: capturing the forward and backward for input {shape}")
        # make_graphed_callables refuses autocast's weight cache (a cached cast would outlive the capture)
        with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
            return torch.cuda.make_graphed_callables(_Dense(self.model), sample, allow_unused_input=True)
