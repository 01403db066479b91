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

    @property
    def repository_name(self) -> str:
        return self.repository_uri.split("/", 1)[1]

    def launch_template(self, instance_type: str) -> str:
        """Launch template id for a type. Raises CliError listing the types the stack has."""
        if instance_type not in self.launch_templates:
            catalog.get(instance_type)  # unknown type -> CatalogError with the known ones
            raise CliError(f"the {self.env} training stack has no launch template for {instance_type} "
                           f"(it has: {', '.join(sorted(self.launch_templates))})",
                           f"redeploy with -c launch_template_types={','.join([*self.launch_templates, instance_type])}")
        return self.launch_templates[instance_type]

    def state_machine(self, key: str) -> str:
        """State machine ARN by key (``train-g5-2xlarge``, ``scaling-plan``). Raises CliError listing them."""
        if key not in self.state_machines:
            raise CliError(f"no state machine {key!r} in the {self.env} training stack (it has: "
                           f"{', '.join(sorted(self.state_machines))})", "redeploy with -c sagemaker_instance_types=...")
        return self.state_machines[key]


def _stack_outputs(cfn, env: str, stack_id: str) -> dict[str, str]:
    name = f"{env}-{stack_id}"
    try:
        stacks = cfn.describe_stacks(StackName=name)["Stacks"]
    except ClientError as e:
        raise explain(e, f"reading stack {name}", env=env) from None
    stack = stacks[0]
    if stack["StackStatus"] not in ("CREATE_COMPLETE", "UPDATE_COMPLETE", "UPDATE_ROLLBACK_COMPLETE"):
        raise CliError(f"stack {name} is {stack['StackStatus']}",
                       f"wait for it, or redeploy with `npx cdk deploy TrainingStack -c env={env}`")
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}


def load(aws: Aws, cfn=None) -> Outputs:
    """Read the three stacks' outputs. Raises CliError when a stack is missing or not in a usable state."""
    cfn = cfn or aws.client("cloudformation")
    data = _stack_outputs(cfn, aws.env, "DataStack")
    mon = _stack_outputs(cfn, aws.env, "MonitoringStack")
    train = _stack_outputs(cfn, aws.env, "TrainingStack")
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
    try:
        return Outputs(env=aws.env, bucket=data["BucketName"], volume_id=data["DataVolumeId"],
                       availability_zone=data["AvailabilityZone"], repository_uri=train["RepositoryUri"],
                       alarm_topic_arn=mon["AlarmTopicArn"], train_log_group=mon["TrainLogGroup"],
                       launch_templates=lts, state_machines=sms)
    except KeyError as e:
        raise CliError(f"the {aws.env} stacks lack output {e.args[0]!r}: deployed by an older version?",
                       "redeploy: `npx cdk deploy TrainingStack -c env=" + aws.env + "`") from None


def image_exists(aws: Aws, outputs: Outputs, tag: str, ecr=None) -> Optional[str]:
    """Digest of ``repository:tag``. Raises CliError (image missing -> push-image) if it is not there."""
    ecr = ecr or aws.client("ecr")
    try:
        found = ecr.describe_images(repositoryName=outputs.repository_name, imageIds=[{"imageTag": tag}])
    except ClientError as e:
        raise explain(e, f"looking for image {outputs.repository_uri}:{tag}") from None
    return found["imageDetails"][0].get("imageDigest")
