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

EXIT_OK, EXIT_USAGE, EXIT_NONFINITE, EXIT_INTERRUPTED = 0, 2, 3, 75


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


def build_parser() -> argparse.ArgumentParser:
    """The ``trainer`` argument parser with its sub-commands."""
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Trainstack trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (single process or under torchrun)",
                           description="Train a model. Flags override --config; defaults are "
                                       "trainer/config.py's TrainConfig.")
    _add_train_flags(train)
    from trainer.planning_cli import add_planning_commands  # probe, plan (issue 6)

    add_planning_commands(sub, _add_train_flags)
    from trainer.data.ffcv_writer import add_write_ffcv_command  # issue 8

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
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
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
