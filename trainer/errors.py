"""The trainer's error types and exit statuses: one home for both.

Exit statuses (``python -m trainer``, the ranks under torchrun, and the image's ``train`` entrypoint):

* 0 ``EXIT_OK``: done.
* 2 ``EXIT_USAGE``: bad config, data or checkpoint: do not retry unchanged (argparse's own usage status).
* 3 ``EXIT_NONFINITE``: the loss became NaN/inf; checkpoints before that step are intact.
* 75 ``EXIT_INTERRUPTED``: stopped on request (SIGTERM, Ctrl-C, spot interruption notice) after a durable
  checkpoint: run the same command again to resume (EX_TEMPFAIL of sysexits.h, "try again later").
* 130 ``EXIT_ABORTED``: aborted by a second Ctrl-C (128 + SIGINT, the shell's convention): no checkpoint for
  the step in flight; checkpoints already durable stay, half-written ones are removed.

Every error below carries a message that names the field, file, path or step and what was expected; the
command-line layers print it as one line and return :func:`exit_code` of it.
"""

from __future__ import annotations

EXIT_OK, EXIT_USAGE, EXIT_NONFINITE, EXIT_INTERRUPTED, EXIT_ABORTED = 0, 2, 3, 75, 130


class ConfigError(ValueError):
    """A config value is invalid. The message names the field, the value and what is allowed."""


class DataError(RuntimeError):
    """The dataset on disk cannot be trained on (missing split, empty class, class mismatch, too many bad
    files). The message names the folder or file and what was expected."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, of an unknown format, or does not match this run (model,
    label space, config); or a checkpoint cannot be written. The message names the path."""


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
