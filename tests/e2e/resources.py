"""Every resource of a deployed stack, read back through the AWS APIs (not the stack status).

:func:`check_stack` walks the synthesized template's resources, finds each one's physical id in
``ListStackResources`` and calls the checker of its type, which reads the resource from its own service and
compares what matters with the template (instance type, spot options, IMDSv2, user data, volume size, alarm
threshold, rule targets, the function's code...). A checker raises ``AssertionError`` naming the resource; a
type with no checker fails the check (so a new resource type cannot go unchecked). Types the emulator does not
create (:data:`NOT_CREATED`) are counted and reported instead.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import io
import json
import zipfile
from collections.abc import Callable
from typing import Any

#: Types the emulator does not create at all, and why (the e2e test prints them with their counts).
NOT_CREATED = {"AWS::CDK::Metadata": "the CDK's version report; CloudFormation keeps it, no API reads it"}
NO_PHYSICAL_ID = ("AWS::EC2::SecurityGroupIngress", "AWS::Lambda::Permission")
Checker = Callable[["Ctx", str, dict], str]
CHECKERS: dict[str, Checker] = {}


class Ctx:
    """What a checker needs: clients on the emulator, the stack's outputs, and other stacks' exports."""

    def __init__(self, client, outputs: dict[str, str], assets: dict[str, bytes], physical: dict[str, str]):
        self.client = client  # service name -> boto3 client
        self.physical = physical  # logical id -> physical id, this stack
        self.outputs = outputs
        self.assets = assets  # S3 key in the bootstrap bucket -> bytes


def checker(*types: str):
    def register(fn: Checker) -> Checker:
        for t in types:
            CHECKERS[t] = fn
        return fn

    return register


def _props(res: dict) -> dict:
    return res.get("Properties", {})


def resolve_refs(value: Any, physical: dict[str, str]) -> Any:
    """``{"Ref": LogicalId}`` of a resource in the same stack -> its physical id (what CloudFormation's Ref gives
    for the types compared here), and a security group's ``GroupId``; other intrinsic functions stay as they are
    and the checkers compare only literal values."""
    if isinstance(value, dict):
        if set(value) == {"Ref"} and value["Ref"] in physical:
            return physical[value["Ref"]]
        getatt = value.get("Fn::GetAtt") if len(value) == 1 else None
        if getatt and getatt[1] == "GroupId" and getatt[0] in physical:  # a security group's id is its Ref
            return physical[getatt[0]]
        return {k: resolve_refs(v, physical) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_refs(v, physical) for v in value]
    return value


def _literal(value: Any) -> bool:
    return not isinstance(value, (dict, list))


@checker("AWS::S3::Bucket")
def _bucket(ctx, pid, res):
    s3 = ctx.client("s3")
    s3.head_bucket(Bucket=pid)
    p = _props(res)
    if p.get("VersioningConfiguration", {}).get("Status") == "Enabled":
        assert s3.get_bucket_versioning(Bucket=pid).get("Status") == "Enabled", f"{pid}: not versioned"
    if "BucketEncryption" in p:
        rules = s3.get_bucket_encryption(Bucket=pid)["ServerSideEncryptionConfiguration"]["Rules"]
        assert rules, f"{pid}: no encryption rule"
    if "PublicAccessBlockConfiguration" in p:
        block = s3.get_public_access_block(Bucket=pid)["PublicAccessBlockConfiguration"]
        assert all(block.values()), f"{pid}: public access not blocked: {block}"
    return "exists, versioning/encryption/public-access block as templated"


@checker("AWS::S3::BucketPolicy")
def _bucket_policy(ctx, pid, res):
    policy = json.loads(ctx.client("s3").get_bucket_policy(Bucket=pid)["Policy"])
    want = len(_props(res)["PolicyDocument"]["Statement"])
    assert len(policy["Statement"]) == want, f"{pid}: {len(policy['Statement'])} statements, template {want}"
    return f"{want} statements"


@checker("AWS::IAM::Role")
def _role(ctx, pid, res):
    role = ctx.client("iam").get_role(RoleName=pid)["Role"]
    p = _props(res)
    trusted = json.dumps(role["AssumeRolePolicyDocument"])
    for st in p["AssumeRolePolicyDocument"]["Statement"]:
        services = st["Principal"].get("Service", []) if isinstance(st["Principal"], dict) else []
        for svc in [services] if isinstance(services, str) else services:
            assert svc in trusted, f"{pid}: {svc} not trusted"
    attached = ctx.client("iam").list_attached_role_policies(RoleName=pid)["AttachedPolicies"]
    assert len(attached) == len(p.get("ManagedPolicyArns", [])), f"{pid}: {attached}"
    return f"trust + {len(attached)} managed policies"


@checker("AWS::IAM::Policy")
def _policy(ctx, pid, res):
    p = _props(res)
    iam = ctx.client("iam")
    roles = [r for r in p.get("Roles", []) if _literal(r)]
    for role in roles:
        doc = iam.get_role_policy(RoleName=role, PolicyName=p["PolicyName"])["PolicyDocument"]
        doc = json.loads(doc) if isinstance(doc, str) else doc
        want = len(p["PolicyDocument"]["Statement"])
        assert len(doc["Statement"]) == want, f"{pid} on {role}: {len(doc['Statement'])} statements, template {want}"
    assert roles, f"{pid}: attached to no role"
    return f"inline on {len(roles)} role(s), {len(p['PolicyDocument']['Statement'])} statements"


@checker("AWS::IAM::InstanceProfile")
def _profile(ctx, pid, res):
    prof = ctx.client("iam").get_instance_profile(InstanceProfileName=pid)["InstanceProfile"]
    assert prof["Roles"], f"{pid}: no role"
    return f"role {prof['Roles'][0]['RoleName']}"


@checker("AWS::Logs::LogGroup")
def _log_group(ctx, pid, res):
    groups = ctx.client("logs").describe_log_groups(logGroupNamePrefix=pid)["logGroups"]
    g = next(g for g in groups if g["logGroupName"] == pid)
    want = _props(res).get("RetentionInDays")
    assert g.get("retentionInDays") == want, f"{pid}: retention {g.get('retentionInDays')}, template {want}"
    return f"retention {want} days"


@checker("AWS::Logs::MetricFilter")
def _metric_filter(ctx, pid, res):
    group, name = pid.split("|", 1)
    filters = ctx.client("logs").describe_metric_filters(logGroupName=group)["metricFilters"]
    f = next(f for f in filters if f["filterName"] == name)
    assert f["filterPattern"] == _props(res)["FilterPattern"], f
    return f"-> {f['metricTransformations'][0]['metricName']}"


@checker("AWS::CloudWatch::Alarm")
def _alarm(ctx, pid, res):
    alarms = ctx.client("cloudwatch").describe_alarms(AlarmNames=[pid])["MetricAlarms"]
    assert alarms, f"alarm {pid} missing"
    a, p = alarms[0], _props(res)
    assert a["Threshold"] == float(p["Threshold"]) and a["ComparisonOperator"] == p["ComparisonOperator"], a
    assert a.get("MetricName") == p.get("MetricName") and len(a.get("Metrics", [])) == len(p.get("Metrics", [])), a
    assert len(a["AlarmActions"]) == len(p.get("AlarmActions", [])), a
    return f"{p.get('MetricName') or 'math'} {p['ComparisonOperator']} {p['Threshold']}"


@checker("AWS::CloudWatch::Dashboard")
def _dashboard(ctx, pid, res):
    body = json.loads(ctx.client("cloudwatch").get_dashboard(DashboardName=pid)["DashboardBody"])
    return f"{len(body['widgets'])} widgets"


@checker("AWS::Events::Rule")
def _rule(ctx, pid, res):
    events = ctx.client("events")
    name = pid.split("|")[-1].split("/")[-1]
    rule = events.describe_rule(Name=name)
    p = _props(res)
    if "EventPattern" in p:
        assert json.loads(rule["EventPattern"]) == p["EventPattern"], rule
    if "ScheduleExpression" in p:
        assert rule["ScheduleExpression"] == p["ScheduleExpression"], rule
    targets = events.list_targets_by_rule(Rule=name)["Targets"]
    assert len(targets) == len(p.get("Targets", [])), (
        f"{name}: {len(targets)} targets, template {len(p.get('Targets', []))}"
    )
    return f"{rule['State']}, {len(targets)} target(s)"


@checker("AWS::KMS::Key")
def _key(ctx, pid, res):
    kms = ctx.client("kms")
    meta = kms.describe_key(KeyId=pid)["KeyMetadata"]
    assert meta["Enabled"], meta
    if _props(res).get("EnableKeyRotation"):
        assert kms.get_key_rotation_status(KeyId=pid)["KeyRotationEnabled"], f"{pid}: rotation off"
    return "enabled" + (", rotation on" if _props(res).get("EnableKeyRotation") else "")


@checker("AWS::SNS::Topic")
def _topic(ctx, pid, res):
    attrs = ctx.client("sns").get_topic_attributes(TopicArn=pid)["Attributes"]
    if "KmsMasterKeyId" in _props(res):
        assert attrs.get("KmsMasterKeyId"), f"{pid}: not encrypted"
    return "KMS-encrypted" if attrs.get("KmsMasterKeyId") else "exists"


@checker("AWS::SNS::TopicPolicy")
def _topic_policy(ctx, pid, res):
    p = _props(res)
    for arn in p["Topics"]:
        policy = json.loads(ctx.client("sns").get_topic_attributes(TopicArn=arn)["Attributes"]["Policy"])
        assert len(policy["Statement"]) == len(p["PolicyDocument"]["Statement"]), policy
    return f"{len(p['PolicyDocument']['Statement'])} statements"


@checker("AWS::SQS::Queue")
def _queue(ctx, pid, res):
    attrs = ctx.client("sqs").get_queue_attributes(QueueUrl=pid, AttributeNames=["All"])["Attributes"]
    return f"retention {attrs.get('MessageRetentionPeriod')} s"


@checker("AWS::SQS::QueuePolicy")
def _queue_policy(ctx, pid, res):
    p = _props(res)
    for url in p["Queues"]:
        attrs = ctx.client("sqs").get_queue_attributes(QueueUrl=url, AttributeNames=["Policy"])["Attributes"]
        assert len(json.loads(attrs["Policy"])["Statement"]) == len(p["PolicyDocument"]["Statement"]), attrs
    return f"{len(p['PolicyDocument']['Statement'])} statements"


@checker("AWS::ECR::Repository")
def _repository(ctx, pid, res):
    repo = ctx.client("ecr").describe_repositories(repositoryNames=[pid])["repositories"][0]
    p = _props(res)
    assert repo["imageTagMutability"] == p.get("ImageTagMutability", "MUTABLE"), repo
    assert repo["imageScanningConfiguration"]["scanOnPush"] == p["ImageScanningConfiguration"]["ScanOnPush"], repo
    if "LifecyclePolicy" in p:
        ctx.client("ecr").get_lifecycle_policy(repositoryName=pid)
    return f"{repo['imageTagMutability']}, scan on push, lifecycle policy"


@checker("AWS::Lambda::Function")
def _function(ctx, pid, res):
    fn = ctx.client("lambda").get_function(FunctionName=pid)
    conf, p = fn["Configuration"], _props(res)
    assert conf["Handler"] == p["Handler"] and conf["Runtime"] == p["Runtime"], conf
    key = p["Code"]["S3Key"]
    code = ctx.assets[key]
    assert conf["CodeSha256"] == base64.b64encode(hashlib.sha256(code).digest()).decode(), f"{pid}: other code"
    names = zipfile.ZipFile(io.BytesIO(code)).namelist()
    module = p["Handler"].rsplit(".", 1)[0].replace(".", "/") + ".py"
    assert module in names, f"{pid}: {module} not in the published code ({len(names)} files)"
    return f"{conf['Runtime']} {conf['Handler']}, code = the CLI's asset {key[:12]}... ({len(names)} files)"


def _getatt_physical(ctx, value):
    """A ``Fn::GetAtt [X, Arn]`` of a function or rule in this stack -> X's physical id (its name)."""
    return ctx.physical[value["Fn::GetAtt"][0]] if not _literal(value) else value


@checker("AWS::Lambda::Permission")
def _permission(ctx, pid, res):
    p = _props(res)
    function = _getatt_physical(ctx, p["FunctionName"])
    source = p.get("SourceArn")
    if not _literal(source):
        source = ctx.client("events").describe_rule(Name=_getatt_physical(ctx, source).split("|")[-1])["Arn"]
    policy = json.loads(ctx.client("lambda").get_policy(FunctionName=function)["Policy"])
    assert any(
        st["Principal"].get("Service") == p["Principal"]
        and st.get("Condition", {}).get("ArnLike", {}).get("AWS:SourceArn") == source
        for st in policy["Statement"]
    ), f"{function}: no statement for {p['Principal']} from {source}"
    return f"{p['Principal']} may invoke, from {source.rsplit('/', 1)[-1]}"


@checker("AWS::Lambda::EventInvokeConfig")
def _invoke_config(ctx, pid, res):
    conf = ctx.client("lambda").get_function_event_invoke_config(FunctionName=pid)
    p = _props(res)
    assert conf["MaximumRetryAttempts"] == p["MaximumRetryAttempts"], conf
    dest = conf["DestinationConfig"]["OnFailure"]["Destination"]
    want = p["DestinationConfig"]["OnFailure"]["Destination"]
    if _literal(want):
        assert dest == want, conf
    assert dest.startswith("arn:aws:sqs:"), dest
    ctx.client("sqs").get_queue_url(QueueName=dest.rsplit(":", 1)[-1])  # the on-failure queue exists
    return f"{p['MaximumRetryAttempts']} retries, on failure -> {dest.rsplit(':', 1)[-1]}"


@checker("AWS::StepFunctions::StateMachine")
def _state_machine(ctx, pid, res):
    sm = ctx.client("stepfunctions").describe_state_machine(stateMachineArn=pid)
    definition = json.loads(sm["definition"])
    assert definition["States"], pid
    assert sm["roleArn"].startswith("arn:aws:iam::"), sm["roleArn"]
    return f"{len(definition['States'])} states"


def check_stack(
    session, endpoint: str, stack_name: str, template: dict, assets: dict[str, bytes], outputs: dict[str, str]
) -> dict:
    """Check every resource of ``stack_name`` against ``template`` (``outputs``: the environment's stack outputs,
    ``assets``: the bootstrap bucket's objects by key); returns ``{"checked": Counter of types,
    "not_created": Counter, "lines": [one line per resource]}``. Raises AssertionError on the first mismatch,
    naming the stack, the logical id and the type."""
    clients: dict[str, Any] = {}

    def client(name: str):
        if name not in clients:
            clients[name] = session.client(name, endpoint_url=endpoint)
        return clients[name]

    from tests.e2e import checks_ec2  # noqa: F401  (registers the EC2 checkers)

    cfn = client("cloudformation")
    summaries = cfn.get_paginator("list_stack_resources").paginate(StackName=stack_name)
    physical = {
        r["LogicalResourceId"]: r.get("PhysicalResourceId")
        for page in summaries
        for r in page["StackResourceSummaries"]
    }
    ctx = Ctx(client, outputs, assets, physical)
    checked, not_created, lines = collections.Counter(), collections.Counter(), []
    for logical, res in template["Resources"].items():
        kind = res["Type"]
        if kind in NOT_CREATED:
            not_created[kind] += 1
            continue
        assert logical in physical, f"{stack_name}: {logical} ({kind}) was not created"
        pid = physical[logical]
        # moto gives these two no physical id (AWS: the rule's id, the statement id); their checkers read the group
        # and the function's policy
        assert pid or kind in NO_PHYSICAL_ID, f"{stack_name}: {logical} ({kind}) has no id"
        assert kind in CHECKERS, f"{stack_name}: no check for {kind} ({logical})"
        try:
            lines.append(f"{logical} ({kind}): {CHECKERS[kind](ctx, pid, resolve_refs(res, physical))}")
        except Exception as e:
            raise AssertionError(f"{stack_name}: {logical} ({kind}, {pid}): {type(e).__name__}: {e}") from e
        checked[kind] += 1
    return {"checked": checked, "not_created": not_created, "lines": lines}
