"""Command line: ``python -m trainer train [--config FILE] [--<field> VALUE ...]``.

Every :class:`trainer.config.TrainConfig` field is a flag (``batch_size`` -> ``--batch-size``; booleans get
``--x/--no-x``). Seed 003's spellings work as written: ``--amp`` (precision=amp), ``--no-amp``
(precision=32), ``--use-ema``, ``--auto-resume/--no-auto-resume``, ``--resume PATH``. Flags override the
YAML file. Works unchanged under ``torchrun --nproc-per-node N -m trainer train ...``.

Exit codes: 0 done; 2 bad config/data/checkpoint (nothing trained); 3 loss became NaN/inf;
75 interrupted (SIGTERM/SIGINT/spot notice) after a durable checkpoint: run the same command again to resume
(75 is EX_TEMPFAIL of sysexits.h, "try again later").
"""

from __future__ import annotations

import argparse

import sys
from typing import Optional, Sequence

from trainer.config import FIELDS, ConfigError, load_config

from trainer.errors import EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_OK, EXIT_USAGE  # noqa: F401


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file of config fields (flags below override it)")
    for name, f in FIELDS.items():
        flag = f.metadata.get("flag") or "--" + name.replace("_", "-")
        kw = {"dest": name, "default": argparse.SUPPRESS, "help": (f.metadata.get("help") or "").replace("%", "%%")}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
            if name == "precision":
                kw.pop("choices")  # aliases such as 16-mixed/bf16 are normalised by the config
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            p.add_argument(flag, metavar=name.upper(), **kw)
        for alias in f.metadata.get("aliases", ()):
            a = "--" + alias.replace("_", "-")
            if isinstance(f.default, bool):
                p.add_argument(a, action=argparse.BooleanOptionalAction, dest=name, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
            else:
                p.add_argument(a, dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--amp", dest="precision", action="store_const", const="amp", default=argparse.SUPPRESS,
                   help="Mixed precision: bf16 where supported, fp16 + GradScaler otherwise (seed 003).")
    p.add_argument("--no-amp", dest="precision", action="store_const", const="32", default=argparse.SUPPRESS,
                   help="Same as --precision 32.")


#: Sub-commands and their one-line help; a command's flags (and its module) are loaded only when it runs.
COMMANDS = {
    "train": "train a model (single process or under torchrun)",
    "probe": "measure memory, speed and loader throughput on this machine",
    "plan": "rank instance types by fit, time and cost for a config",
    "write-ffcv": "convert ImageFolder splits into FFCV .beton files",
}


def _requested_command(argv: Sequence[str]) -> Optional[str]:
    """The sub-command named in ``argv`` (its first non-option word), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: Optional[str] = "train") -> argparse.ArgumentParser:
    """The ``trainer`` argument parser; only ``command``'s flags are built (and its module imported).

    Other sub-commands are listed with their help line, so ``python -m trainer --help`` imports nothing
    heavy and ``train`` never imports the planning modules (which need torch and the instance catalog).
    """
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Trainstack trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_line in COMMANDS.items():
        if name == command:
            continue
        sub.add_parser(name, help=help_line, add_help=False)
    if command == "train":
        train = sub.add_parser("train", help=COMMANDS["train"],
                               description="Train a model. Flags override --config; defaults are "
                                           "trainer/config.py's TrainConfig.")
        _add_train_flags(train)
    elif command in ("probe", "plan"):
        from trainer.planning_cli import add_planning_command

        add_planning_command(sub, command, _add_train_flags)
    elif command == "write-ffcv":
        from trainer.data.ffcv_writer import add_write_ffcv_command

        add_write_ffcv_command(sub)
    return parser


def _config_from_namespace(ns: argparse.Namespace):
    values = {k: v for k, v in vars(ns).items() if k in FIELDS}
    return load_config(getattr(ns, "config", None), values)


def parse_train_config(argv: Sequence[str]):
    """Parse ``train`` arguments (without the sub-command) into a validated TrainConfig.

    Raises ConfigError for invalid values; argparse exits with code 2 for unknown flags or bad choices.
    """
    return _config_from_namespace(build_parser().parse_args(["train", *argv]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m trainer``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _requested_command(argv)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    if args.command == "train":
        try:
            cfg = _config_from_namespace(args)
        except ConfigError as e:
            print(f"error: config: {e}", file=sys.stderr)
            return EXIT_USAGE
        from trainer.train import run

        return run(cfg)
    if args.command in ("probe", "plan"):
        from trainer.planning_cli import run_command

        return run_command(args, _config_from_namespace)
    if args.command == "write-ffcv":
        from trainer.data.ffcv_writer import run_write_ffcv

        return run_write_ffcv(args)
    return EXIT_USAGE
