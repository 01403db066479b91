"""The argument parser of ``python -m infra`` (:mod:`infra.cli.main` runs what it parses): every command's
options with their defaults, and the argparse types that refuse bad values before any AWS call (whole numbers,
USD amounts, comma-separated EC2 types)."""

from __future__ import annotations

import argparse
import math

from infra.cli import sweep_plan


def _whole_number(minimum: int):
    """An argparse type: a whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected a whole number >= {minimum}")
        return value

    return parse


_positive_int = _whole_number(1)
_count = _whole_number(0)


def _usd(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected an amount in USD > 0, e.g. 150")
    return value


def _type_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected EC2 types separated by commas, e.g. g5.4xlarge")
    return names


class OneLineUsageParser(argparse.ArgumentParser):
    """Usage errors as one line, ``error: <command>: <what>; see <prog> --help`` (exit 2), the trainer's format,
    instead of argparse's usage block before it; sub-parsers made by ``add_subparsers`` are of this class too."""

    def error(self, message: str):
        command = self.prog.removeprefix("python -m infra").strip() or "infra"
        self.exit(2, f"error: {command}: {message.removeprefix('argument ')}; see {self.prog} --help\n")


def build_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of ``python -m infra``: global options and one sub-parser per command; ``doc`` is the
    command's module docstring (its first paragraph, the command list, is the description). Bad arguments exit 2
    with one line (:class:`OneLineUsageParser`)."""
    p = OneLineUsageParser(
        prog="python -m infra",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--env", help="environment (cdk -c env=...; default: TRAINSTACK_ENV, else dev)")
    p.add_argument("--region", help="AWS region (default: AWS_REGION / profile)")
    p.add_argument("--profile", help="AWS profile")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("push-image", help="build and push the training image")
    s.add_argument("--tag", help="image tag (default: git commit, -dirty when the tree has changes)")
    s.add_argument("--base-image", help="AWS DLC to build FROM (default: the Dockerfile's BASE_IMAGE)")
    s.add_argument(
        "--builder", "--docker", dest="builder", help="docker, podman or buildah binary (default: the first found)"
    )
    s.add_argument("--ca-bundle", help="CA file mounted over the base's for the build (podman/buildah; TLS proxies)")
    s.add_argument("--archs", help="the op's TORCH_CUDA_ARCH_LIST (default: the Dockerfile's, what image-smoke tests)")

    s = sub.add_parser("launch", help="run a spot training instance")
    s.add_argument("instance_type")
    s.add_argument("--job", required=True, help="job name: checkpoints go to /data/checkpoints/JOB")
    s.add_argument("--config", default="configs/p4d_resnet50.yaml", help="trainer config inside the image")
    s.add_argument("--image-tag", help="image tag (default: this checkout's commit, as push-image tags it)")
    s.add_argument("--args", default="", help="extra trainer flags, e.g. '--epochs 5 --data-dir /data/imagenet'")
    s.add_argument("--keep", action="store_true", help="do not shut the instance down when the job is done")
    s.add_argument(
        "--on-demand-fallback", action="store_true", help="launch on-demand when spot capacity or price says no"
    )
    s.add_argument("--no-recover", action="store_true", help="one-shot: no relaunch after an interruption")
    s.add_argument(
        "--fallback-types",
        type=_type_list,
        default=(),
        metavar="T1,T2",
        help="types a relaunch may use when TYPE has no spot capacity (same AZ: the data volume's)",
    )
    s.add_argument(
        "--max-recoveries", type=_count, default=10, help="relaunches after interruptions at most (default 10)"
    )
    s.add_argument("--max-cost-usd", type=_usd, help="stop the job when catalog price x hours reaches this (USD)")

    s = sub.add_parser("submit", help="start a managed-spot SageMaker run")
    s.add_argument("--run-name", required=True, help="keys s3://bucket/checkpoints/RUN/: same name = resume")
    s.add_argument("--machine", default="train-g5-2xlarge", help="state machine: train-<type> or scaling-plan")
    s.add_argument("--config", help="trainer YAML (validated here, sent as hyperparameters)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra hyperparameter")
    s.add_argument("--image-tag", help="image tag (default: this checkout's commit, as push-image tags it)")
    s.add_argument("--data", help="s3:// URI of the train channel (default: s3://bucket/datasets/)")
    s.add_argument("--instance-count", type=_positive_int, default=1)
    s.add_argument("--nproc-per-node", type=int, help="checked against the catalog's GPU count, never sent")

    s = sub.add_parser("sweep", help="a hyperparameter sweep on SageMaker managed spot (infra/cli/sweep.py)")
    s.add_argument("--name", required=True, help="the sweep: trials run as NAME-t000, NAME-t001, ...")
    s.add_argument("--machine", default="train-g5-2xlarge", help="state machine train-<type>: one instance per trial")
    s.add_argument("--config", help="base trainer YAML (validated with every trial here)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="base override")
    s.add_argument("--grid", action="append", default=[], metavar="NAME=[V1,V2]", help="values of one field")
    s.add_argument("--range", action="append", default=[], metavar="NAME=LOW:HIGH[:log][:int]", help="with --random")
    s.add_argument("--random", type=_positive_int, help="N random trials (tuning: N training jobs)")
    s.add_argument(
        "--sweep-seed", type=int, default=0, help="seed of the random trials (tuning: RandomSeed); as the local sweep"
    )
    s.add_argument("--metric", help="objective (default: the task's headline metric, e.g. val_top1)")
    s.add_argument("--strategy", choices=("jobs", "tuning"), default="jobs")
    s.add_argument("--tuning-strategy", choices=sweep_plan.TUNING_STRATEGIES, help="override Grid/Bayesian/Random")
    s.add_argument(
        "--max-parallel", type=_positive_int, default=sweep_plan.DEFAULT_PARALLEL, help="K trials at once (default 2)"
    )
    s.add_argument("--image-tag", help="image tag (default: this checkout's commit, as push-image tags it)")
    s.add_argument("--data", help="s3:// URI of the train channel (default: s3://bucket/datasets/)")
    s.add_argument("--dry-run", action="store_true", help="print the requests as JSON; no AWS call")
    s.add_argument("--plan", help="plan.json of `python -m trainer plan --out`: refuse a type it says does not fit")
    s.add_argument(
        "--retry-failed", action="store_true", help="jobs: restart failed trials too (they resume from checkpoints)"
    )

    s = sub.add_parser("sweep-status", help="a sweep's trials, ranked")
    s.add_argument("--name", required=True)
    s.add_argument("--out", help="folder for results.md/json/png (default: runs/sweeps/NAME)")

    s = sub.add_parser("status", help="what runs in the environment")
    s.add_argument("target", nargs="?", help="an instance id, execution ARN or training job name for its details")
    s.add_argument("--json", action="store_true")

    s = sub.add_parser("logs", help="log tail of an instance or a job")
    s.add_argument("target")
    s.add_argument("-n", "--lines", type=_positive_int, default=50)
    s.add_argument("--follow", action="store_true")

    s = sub.add_parser("stop", help="stop an instance, execution, training job or tuning job")
    s.add_argument("target")

    s = sub.add_parser("teardown", help="remove what still bills (dry run without --yes)")
    s.add_argument("--yes", action="store_true", help="really terminate/cancel/delete")
    s.add_argument(
        "--wait",
        action="store_true",
        help="with --yes: return only when the instances are terminated and the data volume is detached "
        "(what `cdk destroy DataStack` needs; at most 10 min)",
    )

    s = sub.add_parser("cost", help="running resources and their cost so far")
    s.add_argument("--json", action="store_true")
    return p
