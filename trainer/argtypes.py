"""argparse argument types and help texts shared by the sub-commands (``train``, ``export``, ``predict``, ``sweep`` ...).

A helper used by several commands lives below all of them: the commands import this module, never
:mod:`trainer.cli` (which imports the commands).
"""

from __future__ import annotations

import argparse
import re


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


def field_values(items: list[str], flag: str = "--set") -> dict:
    """``FIELD=VALUE`` items (a repeated ``--set``) as a dict of config overrides, each value read as YAML
    (``--set epochs=2`` gives the int 2, ``--set data_dir=/d`` the string). Raises ValueError naming the item and
    the form expected."""
    import yaml

    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected FIELD=VALUE, e.g. {flag} image_size=64")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else value
    return out


#: A unit ``--help`` writes after a default: by the option's name suffix, else by a word of its help text.
_UNIT_BY_SUFFIX = (("_minutes", "min"), ("_s", "s"), ("_seconds", "s"), ("_gib", "GiB"), ("_epochs", "epochs"))
_UNIT_BY_HELP = (
    (re.compile(r"\bpixels\b"), "px"),
    (re.compile(r"\bin GiB\b"), "GiB"),
    (re.compile(r"^Seconds\b"), "s"),
)
#: "default" as a word of the text: not ``DEFAULT`` (a torchvision weights name) nor a path's ``runs/default/``.
_MENTIONS_DEFAULT = re.compile(r"(?<![/\w])[Dd]efault\b(?!/)")


def default_text(value, unit: str = "") -> str:
    """How ``--help`` shows a default: YAML's spellings (``true``/``false``), a list or tuple comma-separated,
    ``not set`` for None or an empty value, else ``str(value)`` followed by ``unit`` (e.g. ``224 px``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None or value == "" or (isinstance(value, (list, tuple)) and not value):
        return "not set"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{text} {unit}" if unit else text


def unit_of(name: str, help_text: str) -> str:
    """The unit of option ``name`` (``spot_poll_interval_s`` -> ``s``, ``memory_limit_gib`` -> ``GiB``), else the one
    its help text names (``pixels`` -> ``px``); ``""`` when neither says."""
    for suffix, unit in _UNIT_BY_SUFFIX:
        if name.endswith(suffix):
            return unit
    return next((unit for pattern, unit in _UNIT_BY_HELP if pattern.search(help_text)), "")


def with_default(help_text: str, name: str, value) -> str:
    """``help_text`` ending with `` (default: VALUE UNIT)`` (:func:`default_text`, :func:`unit_of`), as argparse's
    ArgumentDefaultsHelpFormatter writes it; unchanged when the text already says its default (it contains the word
    "default"), so no option shows two. Plain text: escape ``%`` before giving it to argparse."""
    if _MENTIONS_DEFAULT.search(help_text):
        return help_text
    return f"{help_text} (default: {default_text(value, unit_of(name, help_text))})".lstrip()
