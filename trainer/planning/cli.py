"""Sub-commands ``probe`` and ``plan`` of ``python -m trainer``: their flags are the training fields (``--config``
and every TrainConfig flag, as for ``train``) plus the fields of :class:`trainer.planning.probe.ProbeOptions` /
:class:`trainer.planning.plan.PlanOptions` (``memory_limit_gib`` -> ``--memory-limit-gib``; tuples are comma-separated).

Exit codes: 0 done; 2 bad config, option, instance type, price file or probe report (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainer.argtypes import with_default
from trainer.errors import EXIT_OK, EXIT_USAGE

_HELP = {
    "out_dir": "Where probe.json, probe.md and probe.png go.",
    "start_batch": "First batch per device tried (then doubled).",
    "max_batch": "Largest batch per device tried.",
    "granularity": "Bisection stops when the last fitting and first failing batch are this close.",
    "margin": "Safety margin: the peak must stay below (1 - margin) x the device memory.",
    "memory_limit_gib": "Device memory limit in GiB (CUDA: enforced with set_per_process_memory_fraction; CPU: "
    "a step whose measured peak exceeds it counts as OOM).",
    "steps": "Timed optimizer steps per batch size (after one warm-up step).",
    "workers": "Loader num_workers values to measure, comma-separated (default: 0,2,4 and the config's "
    "num_workers, at most this machine's CPU count).",
    "prefetch": "Loader prefetch_factor values to measure, comma-separated.",
    "loader_batches": "Batches read per loader setting.",
    "probe_report": "probe.json of this config (measured memory and images/s).",
    "prices": 'JSON file of price overrides {"g5.2xlarge": {"spot": 0.45}} (USD/hour; default: the catalog\'s '
    "prices, catalog/__init__.py).",
    "platform": "Only ec2 or only sagemaker (ml.*) types (default: both).",
    "instances": "Only these instance types, comma-separated (default: every type of the catalog).",
    "nproc_per_node": "Processes per host you intend to start; checked against each type's GPU count (default: "
    "not checked).",
    "dataset_size": "Training images per epoch (default: counted in data_dir's train split).",
    "num_classes": "Classes of the model head (default: from data_dir, or 1000 with --dataset-size).",
    "model_memory_gib": "Peak memory per GPU in GiB for a model the trainer cannot build (e.g. DINO); skips "
    "the prediction.",
    "images_per_second": "Measured training images/s per GPU on --throughput-gpu.",
    "throughput_gpu": "Catalog GPU model on which --images-per-second was measured.",
    "scaling_efficiency": "Multi-GPU DDP efficiency per host (assumption; 1.0 = linear).",
    "jobs_per_instance": "Independent training jobs run side by side on one instance: GPUs split (or time-sliced "
    "when jobs > GPUs), host RAM and vCPUs checked for all of them (ERROR when exhausted).",
    "out": "Also write the plan as JSON to this file.",
}


def _parser_for(f: dataclasses.Field) -> Callable:
    t = str(f.type)
    if f.name == "workers" or f.name == "prefetch":
        return lambda s: tuple(int(x) for x in s.split(",") if x.strip())
    if t == "tuple":
        return lambda s: tuple(x.strip() for x in s.split(",") if x.strip())
    return float if "float" in t else int if "int" in t else str


#: The ``--help`` group of each command's own options, named by what a user does there.
_TITLES = {
    "probe": "probing: the batch search and the loader settings measured (not training fields)",
    "plan": "planning: instance types, prices and throughput (not training fields)",
}


def _add_options(p: argparse.ArgumentParser, cls, command: str) -> None:
    """Add a flag per field of ``cls`` (:class:`ProbeOptions` / :class:`PlanOptions`) to ``p``, in one group titled
    :data:`_TITLES` [``command``]; each help ends with its default unless :data:`_HELP` already says it."""
    group = p.add_argument_group(_TITLES[command])
    for f in dataclasses.fields(cls):
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest="opt_" + f.name,
            type=_parser_for(f),
            default=argparse.SUPPRESS,
            metavar=f.name.upper(),
            help=with_default(_HELP.get(f.name, ""), f.name, f.default).replace("%", "%%"),
        )


def add_planning_command(sub, command: str, add_train_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``probe`` or ``plan`` (``command``) on the ``trainer`` sub-parsers."""
    if command == "probe":
        from trainer.planning.options import ProbeOptions

        p = sub.add_parser(
            "probe",
            help="measure memory, speed and loader throughput on this machine",
            description="Find the largest batch that fits with a margin, images/s, loader "
            "throughput and RAM; writes probe.json/.md/.png.",
        )
        add_train_flags(p)
        _add_options(p, ProbeOptions, "probe")
        return
    from trainer.planning.options import PlanOptions

    p = sub.add_parser(
        "plan",
        help="rank instance types by fit, time and cost for a config",
        description="Rank the catalog's instance types for --config and --epochs.",
    )
    add_train_flags(p)
    _add_options(p, PlanOptions, "plan")


def _options(args: argparse.Namespace, cls):
    return cls(**{k[4:]: v for k, v in vars(args).items() if k.startswith("opt_")})


def _check_out_file(path: Path) -> None:
    """Raise PlanError naming ``--out`` when the plan's JSON could not be written there (checked first)."""
    from trainer.planning.options import PlanError

    if path.is_dir():
        raise PlanError(f"--out {path}: is a folder; give a file name such as {path / 'plan.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlanError(f"--out {path}: cannot create its folder {path.parent} ({e.strerror or e})") from None


def run_command(args: argparse.Namespace, config_from_namespace: Callable) -> int:
    """Run ``probe`` or ``plan`` from parsed arguments; returns the exit code."""
    from catalog import CatalogError
    from trainer.config import ConfigError
    from trainer.data.formats.imagefolder import DataError
    from trainer.planning.options import PlanError, PlanOptions, ProbeOptions
    from trainer.planning.plan import make_plan, render_plan
    from trainer.planning.probe import check_out_dir, default_workers, run_probe, write_probe

    try:
        cfg = config_from_namespace(args)
        if args.command == "probe":
            opts = _options(args, ProbeOptions)
            if not any(k == "opt_workers" for k in vars(args)):
                opts.workers = default_workers(cfg)
            opts.validate()
            check_out_dir(opts.out_dir)  # before minutes of measuring
            res = run_probe(cfg, opts, log=lambda m: print(m, flush=True))
            for kind, path in write_probe(res, opts.out_dir).items():
                print(f"probe: {kind}: {path}")
            return EXIT_OK
        opts = _options(args, PlanOptions)
        if opts.out:
            _check_out_file(Path(opts.out))
        t0 = time.perf_counter()
        plan = make_plan(cfg, opts)
        plan["seconds"] = round(time.perf_counter() - t0, 2)
        print(render_plan(plan), end="")
        print(f"plan took {plan['seconds']:.2f} s")
        if opts.out:
            Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
            Path(opts.out).write_text(json.dumps(plan, indent=2) + "\n")
        return EXIT_OK
    except (ConfigError, DataError, PlanError, CatalogError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
