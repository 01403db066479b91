"""The deployed environment's resource names, read from the stacks' outputs (never hard-coded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from botocore.exceptions import ClientError

import catalog
from infra.cli.session import Aws, CliError, explain


@dataclass
class Outputs:
    """What ``describe_stacks`` says about ``<env>-DataStack``, ``-MonitoringStack`` and ``-TrainingStack``."""

    env: str
    bucket: str
    volume_id: str
    availability_zone: str
    repository_uri: str
    alarm_topic_arn: str
    train_log_group: str
    launch_templates: dict[str, str] = field(default_factory=dict)  # instance type -> launch template id
    state_machines: dict[str, str] = field(default_factory=dict)  # "train-g5-2xlarge" / "scaling-plan" -> ARN
    recovery_failure_queue_url: str = ""  # the recovery's failure queue ("" when deployed without that output)

    @property
    def repository_name(self) -> str:
        return self.repository_uri.split("/", 1)[1]

    def launch_template(self, instance_type: str) -> str:
        """Launch template id for a type. Raises CliError listing the types the stack has."""
        if instance_type not in self.launch_templates:
            catalog.get(instance_type)  # unknown type -> CatalogError with the known ones
            raise CliError(
                f"the {self.env} training stack has no launch template for {instance_type} "
                f"(it has: {', '.join(sorted(self.launch_templates))})",
                f"redeploy with -c launch_template_types={','.join([*self.launch_templates, instance_type])}",
            )
        return self.launch_templates[instance_type]

    def state_machine(self, key: str) -> str:
        """State machine ARN by key (``train-g5-2xlarge``, ``scaling-plan``). Raises CliError listing them."""
        if key not in self.state_machines:
            raise CliError(
                f"no state machine {key!r} in the {self.env} training stack (it has: "
                f"{', '.join(sorted(self.state_machines))})",
                "redeploy with -c sagemaker_instance_types=...",
            )
        return self.state_machines[key]


#: Stack states whose outputs the CLI uses (a failed update rolled back to the last good template).
USABLE_STATES = (
    "CREATE_COMPLETE",
    "UPDATE_COMPLETE",
    "UPDATE_ROLLBACK_COMPLETE",
    "IMPORT_COMPLETE",
    "IMPORT_ROLLBACK_COMPLETE",
)
#: States ``teardown`` also accepts: whatever is left of a deploy that failed or a delete that stopped half-way
#: may still run instances, so teardown must work on it (missing outputs are then left empty).
TEARDOWN_STATES = USABLE_STATES + (
    "ROLLBACK_COMPLETE",
    "ROLLBACK_FAILED",
    "UPDATE_ROLLBACK_FAILED",
    "DELETE_FAILED",
    "CREATE_FAILED",
    "UPDATE_FAILED",
    "IMPORT_ROLLBACK_FAILED",
)


def _stack_outputs(cfn, env: str, stack_id: str, partial: bool = False) -> Optional[dict[str, str]]:
    """Outputs of ``<env>-<stack_id>``. With ``partial``, a missing stack gives None and every state of
    :data:`TEARDOWN_STATES` is accepted. Raises CliError for a missing stack or an unusable state."""
    name = f"{env}-{stack_id}"
    try:
        stacks = cfn.describe_stacks(StackName=name)["Stacks"]
    except ClientError as e:
        msg = e.response.get("Error", {}).get("Message", "")
        if partial and "does not exist" in msg:
            return None
        raise explain(e, f"reading stack {name}", env=env) from None
    stack = stacks[0]
    if stack["StackStatus"] not in (TEARDOWN_STATES if partial else USABLE_STATES):
        raise CliError(
            f"stack {name} is {stack['StackStatus']}",
            f"wait for it, or redeploy with `npx cdk deploy TrainingStack -c env={env}`",
        )
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}


def load(aws: Aws, cfn=None, partial: bool = False) -> Outputs:
    """Read the three stacks' outputs. Raises CliError when a stack is missing or not in a usable state.

    ``partial`` (``teardown``): stacks that are missing, rolled back or failed are accepted and what they do
    not say is left empty (``""``, no launch templates, no state machines), none of the three included: an
    environment already destroyed is torn down again by its tags alone, so a second destroy.yml run exits 0.
    """
    cfn = cfn or aws.client("cloudformation")
    found = [_stack_outputs(cfn, aws.env, cid, partial) for cid in ("DataStack", "MonitoringStack", "TrainingStack")]
    data, mon, train = (f or {} for f in found)
    lts = {}
    for name in catalog.names("ec2"):
        key = "LaunchTemplateId" + name.replace(".", "").replace("-", "")
        if key in train:
            lts[name] = train[key]
    prefix = f"trainstack-{aws.env}-"
    sms = {}
    for key, value in train.items():
        if key.startswith("StateMachine") and ":stateMachine:" in value:
            name = value.rsplit(":", 1)[1]
            sms[name.removeprefix(prefix)] = value
    if partial:
        return Outputs(
            env=aws.env,
            bucket=data.get("BucketName", ""),
            volume_id=data.get("DataVolumeId", ""),
            availability_zone=data.get("AvailabilityZone", ""),
            repository_uri=train.get("RepositoryUri", ""),
            alarm_topic_arn=mon.get("AlarmTopicArn", ""),
            train_log_group=mon.get("TrainLogGroup", ""),
            launch_templates=lts,
            state_machines=sms,
            recovery_failure_queue_url=train.get("RecoveryFailureQueueUrl", ""),
        )
    try:
        return Outputs(
            env=aws.env,
            bucket=data["BucketName"],
            volume_id=data["DataVolumeId"],
            availability_zone=data["AvailabilityZone"],
            repository_uri=train["RepositoryUri"],
            alarm_topic_arn=mon["AlarmTopicArn"],
            train_log_group=mon["TrainLogGroup"],
            launch_templates=lts,
            state_machines=sms,
            recovery_failure_queue_url=train.get("RecoveryFailureQueueUrl", ""),
        )
    except KeyError as e:
        raise CliError(
            f"the {aws.env} stacks lack output {e.args[0]!r}: deployed by an older version?",
            "redeploy: `npx cdk deploy TrainingStack -c env=" + aws.env + "`",
        ) from None


def image_exists(aws: Aws, outputs: Outputs, tag: str, ecr=None) -> Optional[str]:
    """Digest of ``repository:tag``. Raises CliError (image missing -> push-image) if it is not there."""
    ecr = ecr or aws.client("ecr")
    try:
        found = ecr.describe_images(repositoryName=outputs.repository_name, imageIds=[{"imageTag": tag}])
    except ClientError as e:
        raise explain(e, f"looking for image {outputs.repository_uri}:{tag}") from None
    return found["imageDetails"][0].get("imageDigest")
