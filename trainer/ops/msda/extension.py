"""Loading of the compiled CUDA extension ``trainer.ops.msda._C`` (built by ``images/build_msda.sh``).

The lowest module of the op: :mod:`~trainer.ops.msda.function` (the checked entry point and autograd Function)
and :mod:`~trainer.ops.msda.library` (the custom operator) both import it, and not each other's loaders.
"""

from __future__ import annotations

from typing import Optional

_ext: Optional[object] = None
_ext_error: Optional[str] = None


def load_extension():
    """The compiled ``_C`` module, or None (reason in :func:`extension_error`)."""
    global _ext, _ext_error
    if _ext is None and _ext_error is None:
        try:
            from trainer.ops.msda import _C

            _ext = _C
        except ImportError as e:
            _ext_error = f"CUDA extension not built or not loadable ({e}); build it with images/build_msda.sh"
    return _ext


def extension_error() -> Optional[str]:
    """Why the extension is unavailable, or None when it loaded."""
    load_extension()
    return _ext_error
