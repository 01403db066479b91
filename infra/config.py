"""One typed infrastructure config, read once from CDK context (``-c key=value`` or cdk.json) and validated.

Every size, type and price the stacks use is a field here, with its default from the seeds:
seed 003 (400 GiB gp3 data volume at 16,000 IOPS, 200 GiB gp3 root, spot p4d.24xlarge), seed 002 (FSx for
Lustre), seeds 000/001 (SageMaker ml.g5.* and ml.m5.xlarge, the CPU-then-GPU scaling phases), seed 001's
"memory below 80 %" alarm. Imports neither torch nor aws_cdk: the CLI reads it too.

Errors: :class:`InfraConfigError`, one line ``context KEY: got VALUE; expected WHAT`` (the CDK app prints it
as ``error: ...`` and exits 2).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import catalog

DLAMI_SSM_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
FSX_DEPLOYMENT_TYPES = ("off", "SCRATCH_2", "PERSISTENT_2")
#: AWS account of the Deep Learning Containers registry (``763104351884.dkr.ecr.<region>.amazonaws.com``) that
#: the training image's base comes from; a cross-account pull needs the caller's own IAM policy to allow it.
DLC_REGISTRY_ACCOUNT = "763104351884"


class InfraConfigError(ValueError):
    """A context value of the wrong type or out of range; the message names the key."""


#: Seed 001's scaling plan, the file ``python -m trainer scale`` runs: its phases are the SageMaker state
#: machine's default steps, so the local run and the SageMaker run share one list of phases.
SCALING_PLAN = Path(__file__).resolve().parents[1] / "configs" / "seed001_scaling.yaml"
#: SageMaker type of a scaling phase by its trainer device: seed 001's CPU instance and its g5 (one A10G).
PHASE_INSTANCE_TYPES = {"cpu": "ml.m5.xlarge", "cuda": "ml.g5.xlarge"}


def phases_from_plan(path: Path = SCALING_PLAN) -> list[dict]:
    """A scaling plan's phases as state-machine steps ``{"name", "instance_type", "hyperparameters"}``.

    The plan format is ``python -m trainer scale``'s (``base`` relative to the plan's folder, plan-wide
    ``overrides``, ``phases`` whose ``overrides`` and ``device`` accumulate); the full reader with the criteria is
    ``trainer.planning.scale.load_plan``, which infra may not import (planning pulls torch), so the phases are
    read here and each merged config is validated with the trainer's pure-Python ``load_config``.
    Hyperparameters: ``config`` = the base config as the image holds it (``configs/<name>``), then the phase's
    cumulative overrides as strings, without ``data_dir`` (a SageMaker job reads its data channel). Instance type:
    :data:`PHASE_INSTANCE_TYPES` of the phase's device (``cuda`` phases on ml.g5.xlarge, the rest ml.m5.xlarge).

    Raises:
        InfraConfigError: the plan cannot be read, is malformed, or a phase's config does not validate.
    """
    import yaml

    from trainer.config import ConfigError, load_config

    try:
        raw = yaml.safe_load(Path(path).read_text())
        base = Path(path).parent / str(raw["base"])
        common = dict(raw.get("overrides") or {})
        cumulative: dict = {}
        steps = []
        for phase in raw["phases"]:
            cumulative.update(phase.get("overrides") or {})
            if phase.get("device"):
                cumulative["device"] = phase["device"]
            merged = {**common, **cumulative}
            device = load_config(base, merged).device
            hps = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in merged.items() if k != "data_dir"}
            steps.append(
                {
                    "name": str(phase["name"]),
                    "instance_type": PHASE_INSTANCE_TYPES["cuda" if device == "cuda" else "cpu"],
                    "hyperparameters": {"config": f"configs/{base.name}", **hps},
                }
            )
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as e:
        raise InfraConfigError(f"scaling plan {path}: cannot read its phases ({type(e).__name__}: {e})") from None
    except ConfigError as e:
        raise InfraConfigError(f"scaling plan {path}: {e}") from None
    return steps


@dataclass(frozen=True)
class InfraConfig:
    """Everything the stacks need, with units in the names (GiB, MiB/s, hours, percent, minutes, USD)."""

    env: str = "dev"
    account: Optional[str] = None
    region: Optional[str] = None
    availability_zone: Optional[str] = None  # default: <region>a
    # data (seed 003)
    data_volume_gib: int = 400
    data_volume_iops: int = 16000
    data_volume_throughput_mibps: int = 1000
    # on `cdk destroy DataStack`: "snapshot", "retain" or "delete"; default "delete" for ephemeral (pull-request)
    # environments, whose snapshots nothing would ever delete, else "snapshot"
    data_volume_removal: str = "snapshot"
    fsx: str = "off"  # seed 002's FSx for Lustre: SCRATCH_2 or PERSISTENT_2 when wanted (costs from creation)
    fsx_storage_gib: int = 1200
    fsx_throughput_mibps_per_tib: int = 250  # PERSISTENT_2 only: 125, 250, 500 or 1000
    fsx_data_path: str = "/datasets"  # file-system path linked to s3://<bucket>/datasets/
    nat_gateways: int = 0  # 0: instances get public IPs (no SSH ingress); 1: private subnet + NAT (all EFA cards)
    # pull-request environments: `cdk destroy DataStack` also empties and deletes both buckets (their objects
    # are gone) and deletes the data volume without a snapshot. Off: buckets retained, volume snapshotted.
    ephemeral: bool = False
    # training (seeds 000, 002, 003)
    launch_template_types: tuple[str, ...] = catalog.DEFAULT_LAUNCH_TEMPLATE_TYPES
    root_volume_gib: int = 200
    ami_parameter: str = DLAMI_SSM_PARAMETER
    ssh_cidr: Optional[str] = None
    spot_max_price_fraction: float = 1.0  # max spot price as a fraction of the catalog's on-demand price
    # a stack-wide default image tag for instances launched without trainstack:image-digest/-tag tags and for
    # executions without "image_tag"; none by default: `python -m infra launch/submit` always name the image
    image_tag: Optional[str] = None
    train_config: str = "configs/p4d_resnet50.yaml"
    sagemaker_instance_types: tuple[str, ...] = ("ml.g5.2xlarge", "ml.g5.xlarge", "ml.m5.xlarge")
    sagemaker_max_run_hours: float = 24.0
    sagemaker_max_wait_hours: float = 48.0
    sagemaker_volume_gib: int = 100
    scaling_phases: tuple[Mapping[str, Any], ...] = field(default_factory=lambda: tuple(phases_from_plan()))
    prices: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # monitoring (seeds 001, 002)
    alarm_email: Optional[str] = None
    budget_usd: float = 100.0
    gpu_low_util_percent: float = 50.0
    gpu_low_util_minutes: int = 15
    gpu_idle_percent: float = 5.0
    gpu_idle_minutes: int = 30
    host_memory_percent: float = 80.0
    disk_percent: float = 85.0
    # GitHub Actions OIDC deploy role
    github_repo: Optional[str] = None  # "owner/name": adds CiStack (OIDC provider + deploy role)
    github_oidc_provider_arn: Optional[str] = None  # reuse the account's provider (one per account)
    # SageMaker managed MLflow: the training roles may log to this tracking server (trainer --tracking mlflow
    # --tracking-uri <this ARN>)
    mlflow_tracking_server_arn: Optional[str] = None

    @property
    def az(self) -> str:
        """The one AZ of the data volume and the instances (EBS volumes attach only within their AZ)."""
        return self.availability_zone or f"{self.region or 'us-east-1'}a"

    @property
    def prefix(self) -> str:
        """Name prefix of this environment's stacks and named resources, e.g. ``trainstack-pr-42``."""
        return f"trainstack-{self.env}"

    def job_phases(self) -> list[str]:
        """Phase names of this environment's SageMaker jobs: one per ``sagemaker_instance_types`` entry
        (``ml.g5.2xlarge`` -> ``g5-2xlarge``) and the scaling plan's phases. Job names are
        ``<prefix>-<phase>-<8 hex>`` (infra.constructs.sagemaker_job.training_job_state)."""
        return [machine_short(t) for t in self.sagemaker_instance_types] + [str(p["name"]) for p in self.scaling_phases]

    def stack_name(self, stack_id: str) -> str:
        """CloudFormation stack name for a construct id: ``pr-42-TrainingStack`` (ids stay unchanged)."""
        return f"{self.env}-{stack_id}"

    def catalog(self) -> dict[str, catalog.InstanceType]:
        """The instance catalog with this config's price overrides applied."""
        return catalog.with_prices(self.prices, source="cdk context 'prices'")


def machine_short(sagemaker_type: str) -> str:
    """``ml.g5.2xlarge`` -> ``g5-2xlarge``: the state machine key ``train-<short>`` and the job phase name."""
    return sagemaker_type.removeprefix("ml.").replace(".", "-")


def state_machine_names(env: str, sagemaker_types: list[str]) -> set[str]:
    """Every name a state machine of environment ``env`` can have: ``trainstack-<env>-train-<short>`` for the
    given SageMaker types and ``trainstack-<env>-scaling-plan``. Matched exactly, never as a prefix:
    ``trainstack-dev-`` also begins every name of an environment ``dev-x``."""
    return {f"trainstack-{env}-train-{machine_short(t)}" for t in sagemaker_types} | {f"trainstack-{env}-scaling-plan"}


#: The environment name rule (``-c env=...``, ``python -m infra --env``): 20 characters keep the bucket name
#: within 63 and the job names within 63.
#: A SageMaker managed MLflow tracking server (AWS Service Authorization Reference, "Amazon SageMaker with MLflow":
#: resource type ``mlflow-tracking-server``, ``arn:${Partition}:sagemaker:${Region}:${Account}:mlflow-tracking-server/
#: ${MlflowTrackingServerName}``; names are 1-63 letters, digits and hyphens).
MLFLOW_SERVER_ARN_RE = re.compile(
    r"^arn:aws[a-z-]*:sagemaker:[a-z]{2}(-[a-z]+)+-[0-9]:[0-9]{12}:mlflow-tracking-server/[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$"
)
ENV_RE = re.compile(r"^[a-z][a-z0-9-]{0,19}$")
ENV_RULE = "lower-case letters, digits and '-', starting with a letter, at most 20 characters"
#: Scaling-plan phase names (they go into SageMaker job names and Step Functions state names).
PHASE_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,15}$")
_DOCKER_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_ACCOUNT_RE = re.compile(r"^[0-9]{12}$")
_REGION_RE = re.compile(r"^[a-z]{2}(-[a-z]+)+-[0-9]$")
_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


def _bad(key: str, value: Any, expected: str) -> InfraConfigError:
    """``context KEY: got VALUE; expected WHAT`` (one line: the CDK app prints it as ``error: ...``)."""
    return InfraConfigError(f"context {key}: got {value!r}; expected {expected}")


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Convert a context value (strings from ``-c``, JSON types from cdk.json) to the field's type."""
    if isinstance(value, str) and isinstance(default, (tuple, list, dict)):
        if isinstance(default, tuple) and not value.strip().startswith("["):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _bad(name, value, f"JSON ({e})") from None
    if isinstance(default, bool):
        if isinstance(value, str):
            if value.lower() not in ("true", "false"):
                raise _bad(name, value, "true or false")
            return value.lower() == "true"
        return bool(value)
    if isinstance(default, (int, float)):
        try:
            if isinstance(value, bool):
                raise TypeError(value)
            num = float(value)
        except (TypeError, ValueError):
            raise _bad(name, value, "a number") from None
        if not math.isfinite(num):
            raise _bad(name, value, "a finite number")
        if isinstance(default, int):
            if num != int(num):
                raise _bad(name, value, "a whole number")
            return int(num)
        return num
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)):
            raise _bad(name, value, "a list")
        return tuple(value)
    if isinstance(default, dict):
        if not isinstance(value, Mapping):
            raise _bad(name, value, "a JSON object")
        return value
    if isinstance(value, (list, dict, bool)):
        raise _bad(name, value, "a string")
    return str(value)


def _validate(cfg: InfraConfig) -> None:
    def bad(key: str, expected: str) -> InfraConfigError:
        return _bad(key, getattr(cfg, key), expected)

    if not ENV_RE.match(cfg.env):
        raise bad("env", ENV_RULE)
    if cfg.account is not None and not _ACCOUNT_RE.match(cfg.account):
        raise bad("account", "a 12-digit AWS account id")
    if cfg.region is not None and not _REGION_RE.match(cfg.region):
        raise bad("region", "an AWS region name like us-east-1")
    if cfg.availability_zone is not None and not re.match(
        rf"^{re.escape(cfg.region or '')}[a-z0-9-]*[a-z]$", cfg.availability_zone
    ):
        region = cfg.region or "us-east-1"
        raise bad("availability_zone", f"an AZ of region {region}, like {region}a")
    if not 1 <= cfg.data_volume_gib <= 16384:
        raise bad("data_volume_gib", "1..16384 GiB (gp3 limits)")
    if not 3000 <= cfg.data_volume_iops <= 80000 or cfg.data_volume_iops > 500 * cfg.data_volume_gib:
        raise bad("data_volume_iops", "3000..80000 and at most 500 IOPS per GiB (gp3 limits)")
    if (
        not 125 <= cfg.data_volume_throughput_mibps <= 2000
        or cfg.data_volume_throughput_mibps > cfg.data_volume_iops / 4
    ):
        raise bad("data_volume_throughput_mibps", "125..2000 MiB/s and at most IOPS/4 (gp3 limits)")
    if cfg.data_volume_removal not in ("snapshot", "retain", "delete"):
        raise bad("data_volume_removal", "'snapshot', 'retain' or 'delete'")
    if cfg.fsx not in FSX_DEPLOYMENT_TYPES:
        raise bad("fsx", " or ".join(FSX_DEPLOYMENT_TYPES))
    if cfg.fsx != "off" and (cfg.fsx_storage_gib != 1200 and cfg.fsx_storage_gib % 2400):
        raise bad("fsx_storage_gib", "1200 or a multiple of 2400 GiB (FSx for Lustre SSD sizes)")
    if cfg.fsx == "PERSISTENT_2" and cfg.fsx_throughput_mibps_per_tib not in (125, 250, 500, 1000):
        raise bad("fsx_throughput_mibps_per_tib", "125, 250, 500 or 1000 (PERSISTENT_2)")
    if not cfg.fsx_data_path.startswith("/"):
        raise bad("fsx_data_path", "an absolute file-system path like /datasets")
    if cfg.nat_gateways not in (0, 1):
        raise bad("nat_gateways", "0 or 1")
    if not 1 <= cfg.root_volume_gib <= 16384:
        raise bad("root_volume_gib", "1..16384 GiB (gp3 limits)")
    if cfg.ssh_cidr is not None:
        try:
            if "/" not in cfg.ssh_cidr or ipaddress.IPv4Network(cfg.ssh_cidr, strict=False).prefixlen == 0:
                raise ValueError(cfg.ssh_cidr)
        except ValueError:
            raise bad(
                "ssh_cidr", "an IPv4 CIDR narrower than 0.0.0.0/0 (cdk-nag AwsSolutions-EC23), like 203.0.113.7/32"
            ) from None
    if cfg.image_tag is not None and not _DOCKER_TAG_RE.match(cfg.image_tag):
        raise bad("image_tag", "a Docker tag: up to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'")
    try:
        cat = cfg.catalog()
    except catalog.CatalogError as e:
        raise InfraConfigError(f"context prices: {e}") from None
    for key in ("launch_template_types", "sagemaker_instance_types"):
        want = "ec2" if key == "launch_template_types" else "sagemaker"
        for t in getattr(cfg, key):
            try:
                platform = catalog.get(t, cat).platform
            except catalog.CatalogError as e:
                raise InfraConfigError(f"context {key}: {e}") from None
            if platform != want:
                raise _bad(
                    key, t, "EC2 types (this one is a SageMaker type)" if want == "ec2" else "SageMaker ml.* types"
                )
    if not 0 < cfg.spot_max_price_fraction <= 1:
        raise bad("spot_max_price_fraction", "a fraction in (0, 1] of the on-demand price")
    if cfg.sagemaker_max_run_hours <= 0 or cfg.sagemaker_max_wait_hours < cfg.sagemaker_max_run_hours:
        raise bad(
            "sagemaker_max_wait_hours",
            f"MaxWaitTimeInSeconds >= MaxRuntimeInSeconds > 0 (max_run_hours={cfg.sagemaker_max_run_hours})",
        )
    if cfg.sagemaker_max_wait_hours > 28 * 24:
        raise bad("sagemaker_max_wait_hours", "at most 28 days (SageMaker limit)")
    if not 1 <= cfg.sagemaker_volume_gib <= 16384:
        raise bad("sagemaker_volume_gib", "1..16384 GiB")
    for i, phase in enumerate(cfg.scaling_phases):
        key = f"scaling_phases[{i}]"
        if not isinstance(phase, Mapping) or not {"name", "instance_type"} <= set(phase):
            raise _bad(key, phase, "an object with 'name', 'instance_type' and optional 'hyperparameters'")
        if not isinstance(phase["name"], str) or not PHASE_RE.match(phase["name"]):
            raise _bad(f"{key}.name", phase["name"], "1-16 lower-case letters, digits or '-'")
        try:
            platform = catalog.get(phase["instance_type"], cat).platform
        except catalog.CatalogError as e:
            raise InfraConfigError(f"context {key}.instance_type: {e}") from None
        if platform != "sagemaker":
            raise _bad(f"{key}.instance_type", phase["instance_type"], "an ml.* type")
        if not isinstance(phase.get("hyperparameters") or {}, Mapping):
            raise _bad(f"{key}.hyperparameters", phase["hyperparameters"], "an object of trainer keys and values")
    for key in ("gpu_low_util_percent", "gpu_idle_percent", "host_memory_percent", "disk_percent"):
        if not 0 < getattr(cfg, key) < 100:
            raise bad(key, "a percentage between 0 and 100")
    for key in ("gpu_low_util_minutes", "gpu_idle_minutes"):
        if not 1 <= getattr(cfg, key) <= 1440:
            raise bad(key, "1..1440 minutes")
    if cfg.budget_usd <= 0:
        raise bad("budget_usd", "a positive amount of USD")
    if cfg.alarm_email is not None and not _EMAIL_RE.match(cfg.alarm_email):
        raise bad("alarm_email", "an e-mail address")
    if cfg.github_repo is not None and not re.match(r"^[\w.-]+/[\w.-]+$", cfg.github_repo):
        raise bad("github_repo", "'owner/name'")
    if cfg.github_oidc_provider_arn is not None and not re.match(
        r"^arn:aws[\w-]*:iam::[0-9]{12}:oidc-provider/", cfg.github_oidc_provider_arn
    ):
        raise bad("github_oidc_provider_arn", "arn:aws:iam::ACCOUNT:oidc-provider/token.actions.githubusercontent.com")
    if cfg.mlflow_tracking_server_arn is not None and not MLFLOW_SERVER_ARN_RE.match(cfg.mlflow_tracking_server_arn):
        raise bad("mlflow_tracking_server_arn", "arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME")


def from_context(get: Any) -> InfraConfig:
    """Build the config from a context getter (``app.node.try_get_context``) and ``CDK_DEFAULT_*``.

    Unknown context keys are ignored by CDK itself; known ones are converted and validated.
    Raises InfraConfigError naming the first bad key.
    """
    values: dict[str, Any] = {}
    for f in fields(InfraConfig):
        raw = get(f.name)
        if raw is None:
            continue
        default = f.default if f.default_factory is MISSING else f.default_factory()
        values[f.name] = _coerce(f.name, raw, default if default is not None else "")
    if values.get("ephemeral"):
        values.setdefault("data_volume_removal", "delete")
    values.setdefault("account", os.environ.get("CDK_DEFAULT_ACCOUNT") or None)
    values.setdefault("region", os.environ.get("CDK_DEFAULT_REGION") or None)
    cfg = InfraConfig(**values)
    _validate(cfg)
    return cfg
