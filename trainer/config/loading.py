"""Build a :class:`~trainer.config.TrainConfig` from a YAML file (flat keys, section mappings, or both) and
command-line overrides; every error is one :class:`ConfigError` line naming the (dotted) key and the file."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Optional

import yaml

from trainer.config.fields import ALIASES, FIELDS, FIELDS_BY_SECTION, TrainConfig
from trainer.config.schema import PRECISION_ALIASES, SECTIONS, section_of
from trainer.config.validation import task_section_conflict
from trainer.errors import ConfigError


def _coerce(name: str, value: Any, source: str, key: Optional[str] = None) -> Any:
    """Convert ``value`` to the declared type of field ``name``.

    Raises:
        ConfigError: ``KEY (SOURCE): got VALUE; expected ...`` where KEY is ``key`` as written (e.g.
            ``optim.lr``), else ``name``.
    """
    f = FIELDS[name]
    default = f.default if f.default is not dataclasses.MISSING else None
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if name == "precision":
            v = str(value).strip().lower()
            return PRECISION_ALIASES.get(v, v)
        if name == "canvases" and isinstance(value, (list, tuple)):  # YAML [[H, W], ...] -> "HxW,HxW"
            if not all(isinstance(c, (list, tuple)) and len(c) == 2 for c in value):
                raise ValueError("expected a list of [H, W] pairs, auto, or HxW,HxW,...")
            return ",".join(f"{c[0]}x{c[1]}" for c in value)
        if f.default is dataclasses.MISSING:  # list fields (default_factory)
            return _list(value)
        if "Optional" in typ or default is None:
            if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
                return None
            if "float" in typ:
                if isinstance(value, bool):
                    raise ValueError("expected a number")
                return float(value)
            return _string(value)
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise ValueError("expected true or false")
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        return _string(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key or name} ({source}): got {value!r}; {e}") from None


def _list(value: Any) -> list:
    """A list field's value: a YAML list (items as text; an item that is itself a list, like a colour
    ``[255, 0, 0]``, becomes ``"255,0,0"``; a mapping stays a mapping), a YAML/JSON list written as one string
    (``[{name: a, ...}]``, for the command line), or one string split on ``;`` when it has one, else on ``,``."""
    if isinstance(value, (list, tuple)):
        return [
            dict(v)
            if isinstance(v, dict)
            else ",".join(str(x) for x in v)
            if isinstance(v, (list, tuple))
            else _string(v)
            for v in value
        ]
    if isinstance(value, dict):
        raise ValueError("expected a list, not a mapping")
    text = str(value).strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"not a valid YAML list ({' '.join(str(e).split())})") from None
        return _list(parsed)
    return [x.strip() for x in text.split(";" if ";" in text else ",") if x.strip()]


def _string(value: Any) -> str:
    """``value`` as a string field's value (YAML numbers become their text; lists and mappings are refused)."""
    if isinstance(value, (list, dict)):
        raise ValueError("expected a single value, not a " + ("list" if isinstance(value, list) else "mapping"))
    return str(value)


def _read_yaml(p: Path) -> dict:
    """The top-level mapping of YAML file ``p`` (empty file: ``{}``).

    Raises:
        ConfigError: the file cannot be read, is not YAML, or is not a mapping.
    """
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"config file {p}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {p}: expected a mapping of field: value, got {type(raw).__name__}")
    return raw


def _hint(word: str, candidates: list, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, candidates, n=3)
    return f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""


def _unknown(key: Any, section: Optional[str], where: str) -> ConfigError:
    """The error for a key that names no field (or alias) at the top level or in ``section``."""
    if section is None:
        hint = _hint(str(key), list(FIELDS) + list(ALIASES) + list(SECTIONS))
        return ConfigError(f"{key} ({where}): unknown config key{hint}")
    names = list(FIELDS_BY_SECTION[section])
    keys = names + [a for a, n in ALIASES.items() if n in names]
    hint = _hint(str(key), keys, prefix=section + ".") or f" (its keys: {', '.join(names)})"
    return ConfigError(f"{section}.{key} ({where}): unknown key in section {section}{hint}")


def _yaml_entries(raw: dict, where: str):
    """Yield ``(dotted key as written, field name, value)`` for each field set in the YAML mapping ``raw``.

    A top-level key that is a section name is that section, except that a section name which is also an alias
    holding a single value is the alias (``data: /path`` is data_dir, ``data: {...}`` the section).

    Raises:
        ConfigError: unknown key, a section given a non-mapping, or a field in another section than its own.
    """
    for key, value in raw.items():
        if key in SECTIONS and (key not in ALIASES or value is None or isinstance(value, (dict, list))):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(
                    f"{key} ({where}): section {key} must be a mapping of field: value, got "
                    f"{type(value).__name__} {value!r}"
                )
            for sub, sub_value in (value or {}).items():
                name = ALIASES.get(sub, sub)
                if name not in FIELDS:
                    raise _unknown(sub, key, where)
                if section_of(FIELDS[name]) != key:
                    right = section_of(FIELDS[name])
                    raise ConfigError(
                        f"{key}.{sub} ({where}): {name} belongs to section {right} (write it as "
                        f"{right}.{sub} or as a top-level {sub})"
                    )
                yield f"{key}.{sub}", name, sub_value
        else:
            name = ALIASES.get(key, key)
            if name not in FIELDS:
                raise _unknown(key, None, where)
            yield str(key), name, value


def _file_entries(p: Path) -> dict[str, tuple[str, Any]]:
    """Field name -> (key as written, raw value) for each field set in YAML file ``p``, flat or in sections.

    Raises:
        ConfigError: as :func:`_read_yaml` and :func:`_yaml_entries`, or a field given twice in the file.
    """
    where = f"in {p}"
    entries: dict[str, tuple[str, Any]] = {}
    for key, name, value in _yaml_entries(_read_yaml(p), where):
        if name in entries:
            raise ConfigError(f"{key} ({where}): {name} is given twice (also as {entries[name][0]}); keep one")
        entries[name] = (key, value)
    return entries


def yaml_fields(path: str | Path) -> dict[str, Any]:
    """The fields a YAML config file sets, flattened: field name -> value as written in the file (not coerced
    or validated; aliases resolved to field names, section mappings to their fields). For tools that pass a
    config file on as flat ``--flag value`` pairs (e.g. SageMaker hyperparameters).

    Raises:
        ConfigError: unreadable or non-mapping YAML, an unknown key, a section given a non-mapping, a field in
            another section than its own, or a field given twice.
    """
    return {name: value for name, (_, value) in _file_entries(Path(path)).items()}


#: The embedded default config (``make run``): ``configs/digits.yaml`` beside the ``trainer`` package, in the repo
#: and in the training image (which copies ``configs/`` next to ``trainer/``).
EMBEDDED_DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "digits.yaml"


def embedded_default_for(path: Optional[str | Path], overrides: dict) -> Optional[Path]:
    """The config file a ``train`` run without ``--config`` starts from: :data:`EMBEDDED_DEFAULT` when no
    ``--config`` is given and the command line chooses neither a dataset (``data_dir``) nor another task than
    classification, so ``python -m trainer train`` trains what ``make run`` trains (the README's quick start); else
    ``path`` unchanged (None: the field defaults). Flags still override the file's values.
    """
    if path is not None or not EMBEDDED_DEFAULT.is_file():
        return path
    chosen = {ALIASES.get(k, k) for k in overrides}
    if "data_dir" in chosen or overrides.get("task", "classification") != "classification":
        return path
    return EMBEDDED_DEFAULT


def load_config(path: Optional[str | Path] = None, overrides: Optional[dict] = None) -> TrainConfig:
    """Build a validated config from an optional YAML file and a dict of overrides (overrides win).

    Args:
        path: YAML mapping. Keys are field names or aliases (seed 002's ``compile_model``, seed 003's
            ``target_accuracy``) at the top level, and/or section names (:data:`SECTIONS`) holding mappings of
            their own fields, mixed freely: ``lr: 0.1`` and ``optim: {lr: 0.1}`` are the same config.
        overrides: field name (or alias) -> value, e.g. parsed from the command line; values may be strings.

    Raises:
        ConfigError: unreadable/non-mapping YAML; an unknown key (with the closest known names); a section
            given a non-mapping; a field inside another section than its own; a field given twice in the file
            (flat and nested, or under a name and an alias); a task-section field set to a non-default value
            while another task is selected; or an invalid value (see :meth:`TrainConfig.validate`).
    """
    values: dict[str, Any] = {}
    written: dict[str, tuple[str, str]] = {}  # field name -> (key as written, where)
    if path is not None:
        where = f"in {Path(path)}"
        for name, (key, value) in _file_entries(Path(path)).items():
            values[name] = _coerce(name, value, where, key)
            written[name] = (key, where)
    for key, value in (overrides or {}).items():
        name = ALIASES.get(key, key)
        if name not in FIELDS:
            raise ConfigError(
                f"{key} (command line): unknown config field{_hint(str(key), list(FIELDS) + list(ALIASES))}"
            )
        values[name] = _coerce(name, value, "command line", str(key))
        written[name] = (str(key), "command line")
    task = values.get("task", FIELDS["task"].default)
    for name, value in values.items():
        why = isinstance(task, str) and task_section_conflict(FIELDS[name], value, task)
        if why:
            key, where = written[name]
            raise ConfigError(f"{key} ({where}): {why}")
    return TrainConfig(**values).validate()
