"""Helpers for the infra tests: synthesize the app offline and read what came out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import infra  # noqa: F401  (silences jsii's Node banner before anything imports aws_cdk)

REPO = Path(__file__).resolve().parents[1]


def synth(context: dict, outdir: Path):
    """Synthesize the whole app into ``outdir``; returns (config, {construct id: Template}, {id: template dict})."""
    from aws_cdk.assertions import Template

    from infra.app import build_app

    app, cfg, stacks = build_app(context, outdir=str(outdir))
    assembly = app.synth()
    templates = {cid: Template.from_stack(stack) for cid, stack in stacks.items()}
    raw = {cid: assembly.get_stack_by_name(stack.stack_name).template for cid, stack in stacks.items()}
    return cfg, templates, raw


def resources(template: dict, rtype: str) -> dict[str, dict]:
    """Logical id -> resource of one CloudFormation type."""
    return {k: v for k, v in template["Resources"].items() if v["Type"] == rtype}


def flatten(value: Any, token: str = "<TOKEN>") -> str:
    """A CloudFormation string value with every ``Fn::Join`` joined and every other token as ``token``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::Join" in value:
        sep, parts = value["Fn::Join"]
        return sep.join(flatten(p, token) for p in parts)
    if isinstance(value, dict) and "Fn::Base64" in value:
        return flatten(value["Fn::Base64"], token)
    return token


def state_machine_definitions(template: dict) -> dict[str, dict]:
    """StateMachineName -> parsed Amazon States Language (tokens replaced by ``<TOKEN>``)."""
    out = {}
    for res in resources(template, "AWS::StepFunctions::StateMachine").values():
        props = res["Properties"]
        out[props["StateMachineName"]] = json.loads(flatten(props["DefinitionString"]))
    return out


# ---------------------------------------------------------------- IAM: the synthesized policies against the calls made
#: botocore signing name -> IAM action prefix, where they differ.
IAM_PREFIX = {"monitoring": "cloudwatch"}
#: Calls that need no permission.
UNAUTHORIZED_OK = {"sts:GetCallerIdentity"}


def resolve(value: Any, account: str, region: str, refs: dict | None = None, unknown: str | None = None) -> Any:
    """A CloudFormation value with ``Fn::Join`` joined and pseudo parameters (``AWS::AccountId``, ...) and the
    logical ids in ``refs`` replaced; lists and dicts recursively. Any other token becomes ``unknown``, or
    raises KeyError when ``unknown`` is None."""
    if unknown is not None:
        try:
            return resolve(value, account, region, refs)
        except KeyError:
            if isinstance(value, list):
                return [resolve(v, account, region, refs, unknown) for v in value]
            if isinstance(value, dict) and "Fn::Join" in value:
                sep, parts = value["Fn::Join"]
                return sep.join(resolve(p, account, region, refs, unknown) for p in parts)
            if isinstance(value, dict) and (
                set(value) & {"Ref", "Fn::GetAtt", "Fn::ImportValue", "Fn::Select", "Fn::Sub", "Fn::Split"}
            ):
                return unknown
            if isinstance(value, dict):
                return {k: resolve(v, account, region, refs, unknown) for k, v in value.items()}
            raise
    pseudo = {
        "AWS::AccountId": account,
        "AWS::Region": region,
        "AWS::Partition": "aws",
        "AWS::URLSuffix": "amazonaws.com",
        **(refs or {}),
    }
    if isinstance(value, list):
        return [resolve(v, account, region, refs) for v in value]
    if isinstance(value, dict):
        if "Fn::Join" in value:
            sep, parts = value["Fn::Join"]
            return sep.join(resolve(p, account, region, refs) for p in parts)
        if "Ref" in value:
            return pseudo[value["Ref"]]
        if set(value) & {"Fn::GetAtt", "Fn::ImportValue", "Fn::Select", "Fn::Sub", "Fn::Split"}:
            raise KeyError(f"cannot resolve {value}")
        return {k: resolve(v, account, region, refs) for k, v in value.items()}
    return value


def policy_statements(
    template: dict,
    logical_id_prefix: str,
    account: str,
    region: str,
    refs: dict | None = None,
    unknown: str | None = None,
) -> list[dict]:
    """The resolved statements of every ``AWS::IAM::Policy`` whose logical id starts with ``logical_id_prefix``
    (tokens other than pseudo parameters and ``refs`` become ``unknown``, or raise KeyError when it is None)."""
    out = []
    for lid, res in resources(template, "AWS::IAM::Policy").items():
        if lid.startswith(logical_id_prefix):
            for st in res["Properties"]["PolicyDocument"]["Statement"]:
                out.append(resolve(st, account, region, refs, unknown))
    assert out, f"no IAM policy {logical_id_prefix}* in the template"
    return out


def _glob(pattern: str, value: str) -> bool:
    """IAM's wildcard match: ``*`` any run of characters (colons and slashes included), ``?`` one; case-sensitive."""
    import re

    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, value, re.S) is not None


def _conditions_hold(st: dict, context: dict[str, str]) -> bool:
    """``StringEquals``/``StringLike`` conditions of a statement on the keys given in ``context`` (others are
    not evaluated)."""
    for op, keys in st.get("Condition", {}).items():
        for key, want in keys.items():
            if key not in context or op not in ("StringEquals", "StringLike"):
                continue
            wants = want if isinstance(want, list) else [want]
            value = context[key]
            if not any(w == value if op == "StringEquals" else _glob(w, value) for w in wants):
                return False
    return True


def is_allowed(
    statements: list[dict], action: str, resource: str | None = None, context: dict[str, str] | None = None
) -> bool:
    """Whether an Allow statement grants ``action`` (``service:Operation``, matched case-insensitively as IAM
    does) on ``resource`` (an ARN; None: any resource the statement names). Conditions are evaluated only for
    the keys in ``context`` (e.g. ``iam:AWSServiceName``): they only narrow an Allow, so without a context
    this check finds missing actions and resources, never a too-strict condition."""
    if action in UNAUTHORIZED_OK:
        return True
    for st in statements:
        if st.get("Effect") != "Allow":
            continue
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        if not any(_glob(a.lower(), action.lower()) for a in actions):
            continue
        res = st.get("Resource", [])
        res = res if isinstance(res, list) else [res]
        if (resource is None or any(_glob(r, resource) for r in res)) and _conditions_hold(st, context or {}):
            return True
    return False


def _condition_holds(op: str, want: Any, value: str | None) -> bool:
    """One condition operator on one context value (None: the key is absent from the request). IAM user guide,
    "IAM JSON policy elements: Condition operators": an absent key fails a positive operator and satisfies a
    negated one (``StringNotEquals``); ``...IfExists`` holds when the key is absent."""
    if op.endswith("IfExists"):
        if value is None:
            return True
        op = op[: -len("IfExists")]
    negated = op in ("StringNotEquals", "StringNotLike", "ArnNotLike", "ArnNotEquals")
    if value is None:
        return negated
    wants = [str(w).lower() if op == "Bool" else str(w) for w in (want if isinstance(want, list) else [want])]
    base = {"StringNotEquals": "StringEquals", "StringNotLike": "StringLike", "ArnNotLike": "ArnLike"}.get(op, op)
    if base in ("StringEquals", "ArnEquals", "Bool"):
        hit = (value.lower() if op == "Bool" else value) in wants
    elif base in ("StringLike", "ArnLike"):
        hit = any(_glob(w, value) for w in wants)
    else:
        raise ValueError(f"condition operator {op} is not modelled")
    return hit != negated


def authorized(statements: list[dict], action: str, resource: str, context: dict[str, str]) -> bool:
    """IAM's decision for one action on one resource with the request context ``context`` (condition key ->
    value; a key not given is absent): an explicit Deny whose conditions all hold wins, else an Allow whose
    conditions all hold, else the implicit deny. Every condition is evaluated (unlike :func:`is_allowed`); an
    operator this model does not know raises ValueError. IAM user guide, "Policy evaluation logic"."""

    def matches(st: dict) -> bool:
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        res = st.get("Resource", [])
        res = res if isinstance(res, list) else [res]
        return (
            any(_glob(a.lower(), action.lower()) for a in actions)
            and any(_glob(r, resource) for r in res)
            and all(
                _condition_holds(op, want, context.get(key))
                for op, keys in st.get("Condition", {}).items()
                for key, want in keys.items()
            )
        )

    if any(st.get("Effect") == "Deny" and matches(st) for st in statements):
        return False
    return any(st.get("Effect") == "Allow" and matches(st) for st in statements)


def implied_permissions(action: str, alarm_actions: list[str], account: str) -> list[tuple[str, str, dict]]:
    """What IAM also checks for a call beyond its own action: PutMetricAlarm with an EC2 action
    (``arn:aws:automate:<region>:ec2:...``) needs ``iam:CreateServiceLinkedRole`` for CloudWatch's EC2-actions
    role, in every account where that role does not exist yet (PutMetricAlarm API reference; CloudWatch user
    guide, "Using service-linked roles for CloudWatch": AWSServiceRoleForCloudWatchEvents, trusting
    events.amazonaws.com). Returns (action, resource, condition context) triples."""
    if action == "cloudwatch:PutMetricAlarm" and any(":ec2:" in a for a in alarm_actions if a.startswith("arn:")):
        role = f"arn:aws:iam::{account}:role/aws-service-role/events.amazonaws.com/AWSServiceRoleForCloudWatchEvents"
        return [("iam:CreateServiceLinkedRole", role, {"iam:AWSServiceName": "events.amazonaws.com"})]
    return []


def call_resource(action: str, params: dict, account: str, region: str) -> list[str | None]:
    """The resource ARNs IAM authorizes ``action`` with these API ``params`` on (None where this helper does not
    compute one: any resource of a matching statement is accepted)."""
    if action == "states:StopExecution":
        return [params["executionArn"]]
    if action == "cloudwatch:DeleteAlarms":
        return [f"arn:aws:cloudwatch:{region}:{account}:alarm:{n}" for n in params["AlarmNames"]]
    if action == "cloudwatch:PutMetricAlarm":
        return [f"arn:aws:cloudwatch:{region}:{account}:alarm:{params['AlarmName']}"]
    if action.startswith("ecr:") and "repositoryName" in params:
        return [f"arn:aws:ecr:{region}:{params.get('registryId') or account}:repository/{params['repositoryName']}"]
    if action in ("states:StartExecution", "states:DescribeStateMachine", "states:ListExecutions"):
        return [params["stateMachineArn"]]
    if action == "states:DescribeExecution":
        return [params["executionArn"]]
    if action.startswith("sqs:") and "QueueUrl" in params:  # https://<endpoint>/<account>/<name>
        owner, name = params["QueueUrl"].rstrip("/").split("/")[-2:]
        return [f"arn:aws:sqs:{region}:{owner}:{name}"]
    if action.startswith("sagemaker:") and "HyperParameterTuningJobName" in params:
        name = params["HyperParameterTuningJobName"].lower()  # SageMaker ARNs carry the name in lower case
        return [f"arn:aws:sagemaker:{region}:{account}:hyper-parameter-tuning-job/{name}"]
    if action in ("ecr:GetAuthorizationToken",) or action.split(":")[1].startswith(("Describe", "List")):
        return ["*"]
    return [None]


class CallRecorder:
    """Records ``(IAM action, API params)`` of every call made through boto3 sessions created while installed
    (``install(monkeypatch)`` wraps ``boto3.Session``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def _hook(self, params, model, **_kwargs) -> None:
        sm = model.service_model
        prefix = IAM_PREFIX.get(sm.signing_name, sm.signing_name)
        self.calls.append((f"{prefix}:{model.name}", dict(params)))

    def install(self, monkeypatch, module) -> None:
        """Make ``module.boto3.Session`` (e.g. infra.cli.session) record every call of the sessions it opens."""
        import boto3

        real = boto3.Session

        def session(*args, **kwargs):
            s = real(*args, **kwargs)
            s.events.register("before-parameter-build.*.*", self._hook)
            return s

        monkeypatch.setattr(module.boto3, "Session", session)

    def denied(
        self, statements: list[dict], account: str, region: str, extra: list[tuple[str, str | None]] = ()
    ) -> list[str]:
        """``action on resource`` for every recorded call (and every ``extra`` (action, resource)) the
        statements do not allow."""
        out = []
        for action, params in self.calls:
            for res in call_resource(action, params, account, region):
                if not is_allowed(statements, action, res):
                    out.append(f"{action} on {res or 'its resource'}")
        for action, res in extra:
            if not is_allowed(statements, action, res):
                out.append(f"{action} on {res or 'its resource'}")
        return out


def docker_registry_actions(argv_list: list[list[str]], account: str, region: str) -> list[tuple[str, str]]:
    """The ECR actions a real ``docker`` performs for the recorded fake-docker command lines: ``build`` with an
    ECR ``BASE_IMAGE`` pulls it (BatchGetImage, GetDownloadUrlForLayer on that registry's repository); ``push``
    of an ECR image uploads (BatchCheckLayerAvailability, InitiateLayerUpload, UploadLayerPart,
    CompleteLayerUpload, PutImage)."""
    import re

    def repo_arn(image: str) -> str | None:
        m = re.match(r"^(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com/([^:@]+)", image)
        return f"arn:aws:ecr:{m.group(2)}:{m.group(1)}:repository/{m.group(3)}" if m else None

    out = []
    for argv in argv_list:
        if argv[0] == "build":
            for a in argv:
                if a.startswith("BASE_IMAGE=") and (arn := repo_arn(a.split("=", 1)[1])):
                    out += [(act, arn) for act in ("ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer")]
        elif argv[0] == "push" and (arn := repo_arn(argv[-1])):
            out += [
                (act, arn)
                for act in (
                    "ecr:BatchCheckLayerAvailability",
                    "ecr:InitiateLayerUpload",
                    "ecr:UploadLayerPart",
                    "ecr:CompleteLayerUpload",
                    "ecr:PutImage",
                )
            ]
    return out
