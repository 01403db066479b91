"""Command line: ``python -m trainer train [--config FILE] [--<field> VALUE ...]``.

Every :class:`trainer.config.TrainConfig` field is a flag (``batch_size`` -> ``--batch-size``; booleans get
``--x/--no-x``). Seed 003's spellings work as written: ``--amp`` (precision=amp), ``--no-amp``
(precision=32), ``--use-ema``, ``--auto-resume/--no-auto-resume``, ``--resume PATH``. Flags override the
YAML file. Works unchanged under ``torchrun --nproc-per-node N -m trainer train ...``.

Exit codes: 0 done; 2 bad config/data/checkpoint (nothing trained) or bad usage (argparse: the sub-command's
usage, then the error, last); 3 loss became NaN/inf; 75 interrupted (SIGTERM/SIGINT/SIGHUP/spot notice) after a
durable checkpoint: run the same command again to resume (75 is EX_TEMPFAIL of sysexits.h, "try again later"); 130
aborted by a second Ctrl-C. Under torchrun an error is shown once (:mod:`trainer.failures`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import sys
from collections.abc import Sequence
from typing import Optional

from trainer.argtypes import with_default
from trainer.config import (
    FIELDS,
    FIELDS_BY_SECTION,
    SECTIONS,
    ConfigError,
    choices_of,
    embedded_default_for,
    flag_of,
    load_config,
    section_title,
)
from trainer.errors import EXIT_USAGE


class UsageParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, ``error: <command>: <what>; <see --help>``, exit 2
    (argparse's own status), instead of the sub-command's usage block (115 lines for ``train``) before the line
    that matters. Sub-parsers made through ``add_subparsers`` are of this class too."""

    def error(self, message: str):
        """Print ``error: <command>: <message>; see <prog> --help`` on stderr and exit 2."""
        command = self.prog.removeprefix("python -m trainer").strip() or "trainer"
        self.exit(EXIT_USAGE, f"error: {command}: {message.removeprefix('argument ')}; see {self.prog} --help\n")


def _field_default(f):
    """Field ``f``'s default value (a fresh one for list/dict fields made by ``default_factory``)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _add_field_flags(group, f) -> None:
    """Add field ``f``'s flag (``--x`` VALUE, or ``--x/--no-x`` for a boolean) and its hidden alias flags. Its help
    ends with its default and unit (:func:`trainer.argtypes.with_default`) unless the text already says it."""
    name = f.name
    help_text = f.metadata.get("help") or ""
    if choices_of(f):
        help_text += f" Choices: {', '.join(map(str, choices_of(f)))}."
    help_text = with_default(help_text, name, _field_default(f))
    kw = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
    if name != "precision" and choices_of(f):  # precision: aliases such as bf16/fp16 are normalised by the config
        kw["choices"] = choices_of(f)
    if isinstance(f.default, bool):
        group.add_argument(flag_of(f), action=argparse.BooleanOptionalAction, **kw)
    else:
        group.add_argument(flag_of(f), metavar=name.upper(), **kw)
    for alias in f.metadata.get("aliases", ()):
        a = "--" + alias.replace("_", "-")
        if isinstance(f.default, bool):
            group.add_argument(
                a, action=argparse.BooleanOptionalAction, dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )
        else:
            group.add_argument(a, dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per :class:`~trainer.config.TrainConfig` field to ``p``, in one argument group
    per config section (title: what a user does there, :func:`~trainer.config.section_title`; description: the
    section's line), so ``--help`` lists them by section.

    Aliases (``--compile-model``, ``--data``, seed 003's ``--target-accuracy``) are accepted but hidden; seed 003's
    ``--amp``/``--no-amp`` set ``precision`` (amp / 32) and are listed in the ``speed`` group.
    """
    p.usage = "%(prog)s [-h] [--config FILE] [--FIELD VALUE ...] (the options below)"  # not 130 lines of flags
    p.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of config fields, flat or nested by section (the YAML section names are in the group titles "
        "below); the flags below override it. Default for train: configs/digits.yaml (the quick start) when no "
        "--data-dir or other --task is given, else none (the field defaults shown).",
    )
    for section, description in SECTIONS.items():
        group = p.add_argument_group(section_title(section), description)
        for name in FIELDS_BY_SECTION[section]:
            _add_field_flags(group, FIELDS[name])
        if section == "speed":
            group.add_argument(
                "--amp",
                dest="precision",
                action="store_const",
                const="amp",
                default=argparse.SUPPRESS,
                help="Mixed precision: bf16 where supported, fp16 + GradScaler otherwise (seed 003; same as "
                "--precision amp).",
            )
            group.add_argument(
                "--no-amp",
                dest="precision",
                action="store_const",
                const="32",
                default=argparse.SUPPRESS,
                help="Same as --precision 32.",
            )


#: Sub-commands and their one-line help; a command's flags (and its module) are loaded only when it runs.
COMMANDS = {
    "train": "train a model (single process or under torchrun)",
    "probe": "measure memory, speed and loader throughput on this machine",
    "plan": "rank instance types by fit, time and cost for a config",
    "write-ffcv": "convert ImageFolder splits into FFCV .beton files",
    "predict": "run a checkpoint on a folder of images: drawn PNGs and predictions.json",
    "evaluate": "a checkpoint's validation metrics, no training",
    "scale": "run a scaling plan's phases in order and report measured vs expected",
    "export": "export a checkpoint as ONNX, TorchScript or safetensors with a model card",
    "sweep": "run a hyperparameter sweep here, as many trials at a time as the planner says fit",
}


def _requested_command(argv: Sequence[str]) -> Optional[str]:
    """The sub-command named in ``argv`` (the first known command, else its first non-option word), or None."""
    return next((a for a in argv if a in COMMANDS), next((a for a in argv if not a.startswith("-")), None))


def build_parser(command: Optional[str] = "train") -> argparse.ArgumentParser:
    """The ``trainer`` argument parser; only ``command``'s flags are built (and its module imported).

    Other sub-commands are listed with their help line, so ``python -m trainer --help`` imports nothing
    heavy and ``train`` never imports the planning modules. No command's flags import torch, so ``--help`` and
    usage errors answer at once (tests/test_architecture.py).
    """
    parser = UsageParser(prog="python -m trainer", description="Trainstack trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_line in COMMANDS.items():  # in this order, so usage and "choose from" lists stay stable
        if name != command:
            sub.add_parser(name, help=help_line, add_help=False)
        elif name == "train":
            train = sub.add_parser(
                "train",
                help=help_line,
                description="Train a model. A flag overrides --config, which overrides the defaults shown.",
                epilog="Every field with its YAML key, default, unit and meaning: docs/configuration.md.",
            )
            _add_train_flags(train)
        elif name in ("probe", "plan"):
            from trainer.planning.cli import add_planning_command

            add_planning_command(sub, name, _add_train_flags)
        elif name == "predict":
            from trainer.predict import add_predict_command

            add_predict_command(sub)
        elif name == "evaluate":
            from trainer.evaluate import add_evaluate_command

            add_evaluate_command(sub)
        elif name == "scale":
            from trainer.planning.scale import add_scale_command

            add_scale_command(sub)
        elif name == "export":
            from trainer.export import add_export_command

            add_export_command(sub)
        elif name == "sweep":
            from trainer.planning.sweep import add_sweep_command

            add_sweep_command(sub, _add_train_flags)
        else:
            from trainer.data.formats.ffcv_writer import add_write_ffcv_command

            add_write_ffcv_command(sub)
    return parser


def _config_from_namespace(ns: argparse.Namespace, embedded_default: bool = False):
    """The validated TrainConfig of parsed flags. ``embedded_default``: without ``--config`` (and without a
    dataset or another task on the command line) start from the embedded default, ``configs/digits.yaml``
    (:func:`~trainer.config.embedded_default_for`), and say so on rank 0."""
    values = {k: v for k, v in vars(ns).items() if k in FIELDS}
    path = getattr(ns, "config", None)
    if embedded_default:
        chosen = embedded_default_for(path, values)
        if chosen is not None and path is None:
            from trainer.failures import env_rank

            if env_rank() == 0:
                print(f"config: {chosen} (the embedded default; --config FILE or --data-dir DIR to choose)", flush=True)
        path = chosen
    if path is not None:  # the tracked run's "config" tag (trainer.engine.trainer.Trainer._start_tracking)
        os.environ["TRAINSTACK_CONFIG_FILE"] = str(path)
    return load_config(path, values)


def _command_parser(parser: argparse.ArgumentParser, command: Optional[str]) -> argparse.ArgumentParser:
    """The sub-command's own parser (so its usage line is the one printed), else ``parser``."""
    for action in parser._actions:  # argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command, parser)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``python -m trainer`` arguments. A usage error (unknown flag, invalid choice, missing value) is one
    line naming the sub-command (:class:`UsageParser`); exits 2 on any usage error, 0 after --help."""
    command = _requested_command(argv)
    parser = build_parser(command if command in COMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    if extra:
        _command_parser(parser, getattr(args, "command", None)).error("unrecognized arguments: " + " ".join(extra))
    return args


def parse_train_config(argv: Sequence[str]):
    """Parse ``train`` arguments (without the sub-command) into a validated TrainConfig.

    Raises ConfigError for invalid values; argparse exits with code 2 for unknown flags or bad choices.
    """
    return _config_from_namespace(parse_args(["train", *argv]))


def _parse_in_rank(argv: Sequence[str]) -> argparse.Namespace:
    """:func:`parse_args`; under torchrun a usage error is shown once: rank 0 prints the usage, and the error
    line reaches torchrun's report (:func:`trainer.failures.fail`) instead of being printed by every rank."""
    import os

    from trainer.failures import TORCHELASTIC_ERROR_FILE_ENV, env_rank, fail

    if not os.environ.get(TORCHELASTIC_ERROR_FILE_ENV):
        return parse_args(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_args(argv)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        lines = err.getvalue().rstrip().splitlines() or ["invalid arguments"]
        if env_rank() == 0 and lines[:-1]:
            print("\n".join(lines[:-1]), file=sys.stderr, flush=True)
        raise SystemExit(fail(EXIT_USAGE, lines[-1].removeprefix("error: "))) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m trainer``; returns the process exit code."""
    args = _parse_in_rank(list(sys.argv[1:] if argv is None else argv))
    if args.command == "train":
        try:
            cfg = _config_from_namespace(args, embedded_default=True)
        except ConfigError as e:
            from trainer.failures import fail

            return fail(EXIT_USAGE, str(e))
        from trainer.engine.run import run
        from trainer.sagemaker.job import apply_defaults

        cfg, notes = apply_defaults(cfg)  # in a SageMaker job: its checkpoint folder and periodic checkpoints
        return run(cfg, notes=notes)
    if args.command in ("probe", "plan"):
        from trainer.planning.cli import run_command

        return run_command(args, _config_from_namespace)
    if args.command == "write-ffcv":
        from trainer.data.formats.ffcv_writer import run_write_ffcv

        return run_write_ffcv(args)
    if args.command == "predict":
        from trainer.predict import run_predict

        return run_predict(args)
    if args.command == "evaluate":
        from trainer.evaluate import run_evaluate

        return run_evaluate(args)
    if args.command == "scale":
        from trainer.planning.scale import run_scale_command

        return run_scale_command(args)
    if args.command == "export":
        from trainer.export import run_export

        return run_export(args)
    if args.command == "sweep":
        from trainer.planning.sweep import run_sweep_command

        return run_sweep_command(args)
    return EXIT_USAGE
