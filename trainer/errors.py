"""The trainer's error types and exit statuses: one home for both.

Exit statuses (``python -m trainer``, the ranks under torchrun, and the image's ``train`` entrypoint):

* 0 ``EXIT_OK``: done.
* 2 ``EXIT_USAGE``: bad config, data or checkpoint: do not retry unchanged (argparse's own usage status).
* 3 ``EXIT_NONFINITE``: the loss became NaN/inf; checkpoints before that step are intact.
* 75 ``EXIT_INTERRUPTED``: stopped on request (SIGTERM, Ctrl-C, SIGHUP, spot interruption notice) after a durable
  checkpoint: run the same command again to resume (EX_TEMPFAIL of sysexits.h, "try again later").
* 130 ``EXIT_ABORTED``: aborted by a second Ctrl-C (128 + SIGINT, the shell's convention): no checkpoint for
  the step in flight; checkpoints already durable stay, half-written ones are removed.

Every error below carries a message that names the field, file, path or step and what was expected; the
command-line layers print it as one line and return :func:`exit_code` of it.
"""

from __future__ import annotations

import re

EXIT_OK, EXIT_USAGE, EXIT_NONFINITE, EXIT_INTERRUPTED, EXIT_ABORTED = 0, 2, 3, 75, 130


class ConfigError(ValueError):
    """A config value is invalid. The message names the field, the value and what is allowed."""


class DataError(RuntimeError):
    """The dataset on disk cannot be trained on (missing split, empty class, class mismatch, too many bad
    files). The message names the folder or file and what was expected."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, of an unknown format, or does not match this run (model,
    label space, config); or a checkpoint cannot be written. The message names the path."""


class CheckpointGone(CheckpointError):
    """The checkpoint was deleted while it was being read (the training run writing its folder pruned it after
    writing a newer one): a reader takes the next newest checkpoint instead."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or inf; the message names the global step. Checkpoints written before
    that step are kept untouched."""


def exit_code(exc: BaseException) -> int:
    """The exit status for an error that ends a run: 3 for a non-finite loss, 2 for the input errors above,
    1 for anything else (a bug or an environment failure: its traceback is worth seeing)."""
    if isinstance(exc, NonFiniteLossError):
        return EXIT_NONFINITE
    if isinstance(exc, (ConfigError, DataError, CheckpointError)):
        return EXIT_USAGE
    return 1


#: A C++ source location as PyTorch and torchvision put it in their messages: ``decode_jpeg, /__w/.../x.cpp:171, ``
#: or ``Exception raised from f at /pytorch/x.cpp:12 (most recent call first)``.
_CPP_LOCATION = re.compile(r"(?:\w+, )?/\S+\.(?:c|cc|cpp|cu|cuh|h|hpp):\d+,? ?|Exception raised from .*$")
#: torch.load's refusal of a non-tensor object, which advises retrying with ``weights_only=False`` (arbitrary code
#: execution from an untrusted file); only the refused global is kept.
_WEIGHTS_ONLY = re.compile(r"Weights only load failed.*?(?:Unsupported global: GLOBAL (\S+)|$)", re.S)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def shorten(text: str, limit: int = 200) -> str:
    """``text`` on one line, at most ``limit`` characters, cut at a word boundary with an ellipsis ("…")."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(",;:") + "…"


def error_detail(e: BaseException, limit: int = 200) -> str:
    """``"<Type>: <message>"`` of a library's error (a decoder, ``torch.load``) for a one-line report: C++ source
    locations and torch.load's ``weights_only=False`` advice removed, cut at a word boundary (:func:`shorten`).

    Example: ``RuntimeError('decode_jpeg, /__w/vision/.../decode_jpeg.cpp:171, Image is incomplete or truncated')``
    -> ``"RuntimeError: Image is incomplete or truncated"``.
    """
    text = _ANSI.sub("", str(e))
    refused = _WEIGHTS_ONLY.match(text)
    if refused:
        what = f" (it holds {refused.group(1)})" if refused.group(1) else ""
        text = f"not a file of tensors only{what}"
    text = " ".join(_CPP_LOCATION.sub("", line).strip() for line in text.splitlines() if line.strip())
    return shorten(f"{type(e).__name__}: {text}" if text else type(e).__name__, limit)
