"""argparse argument types shared by the sub-commands (``train``, ``export``, ``predict``, ``sweep`` ...).

A helper used by several commands lives below all of them: the commands import this module, never
:mod:`trainer.cli` (which imports the commands).
"""

from __future__ import annotations

import argparse


def bounded_number(cast, low=None, high=None, why: str = ""):
    """An argparse ``type``: ``cast`` (``int`` or ``float``) of the text, checked against ``low`` / ``high``.

    Errors (argparse prints them as one usage line): ``invalid integer|number: 'x'``, ``must be >= LOW<why>, got
    V`` (only ``low``) or ``must be in [LOW, HIGH], got V``. Raises ``argparse.ArgumentTypeError``."""
    kind = "integer" if cast is int else "number"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind}: {text!r}") from None
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {value}")
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}{why}, got {value}")
        return value

    return parse
